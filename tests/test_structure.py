"""The package's shape (docs/README.md, "Code layout"): three floors and a ground floor, every
import pointing down or sideways, never up; the library importable without Hydra, OmegaConf or
wandb; no import circle and no private name taken across modules."""
import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "repro"
# floor -> the packages on it; a module may import from its own floor and those below
FLOORS = {
    0: ("repro.common",),
    1: ("repro.kernels", "repro.attention", "repro.models"),
    2: ("repro.data", "repro.training", "repro.tasks", "repro.conf", "repro.cli"),
    3: ("repro.reproduction", "repro.report", "repro.reproduce_gpu"),
}


def floor_of(module: str) -> int | None:
    for floor, prefixes in FLOORS.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return floor
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every repro module `path` imports, at any depth (function-local imports too), and every
    `python -m repro.X` or import_module("repro.X") it names as a string."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "repro"}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the floors are read from absolute ones)"
            if node.module and node.module.split(".")[0] == "repro":
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names
                          if (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                          or (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).is_dir()}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("repro.") \
                and node.value.replace(".", "").replace("_", "").isalnum():
            found.add(node.value)
    return found


def test_every_module_sits_on_a_floor():
    loose = [module_name(p) for p in PACKAGE.rglob("*.py") if floor_of(module_name(p)) is None
             and module_name(p) != "repro"]
    assert not loose, f"modules on no floor (tests/test_structure.py FLOORS): {loose}"


def test_no_module_imports_from_a_floor_above_its_own():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        me = module_name(path)
        mine = floor_of(me)
        for dep in imports_of(path):
            theirs = floor_of(dep)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{me} (floor {mine}) imports {dep} (floor {theirs})")
    assert not upward, "\n".join(sorted(upward))


def test_the_floor_check_sees_an_upward_import(tmp_path):
    """The check above can fail: an attention module importing the report is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from repro.reproduction import report\n")
    assert "repro.reproduction.report" in imports_of(bad)
    assert floor_of("repro.attention.linear") < floor_of("repro.reproduction.report")


def test_the_library_imports_without_hydra_omegaconf_or_wandb():
    """Floors 0 and 1, every module of them, in a fresh interpreter where Hydra, OmegaConf and
    wandb cannot be imported; and the README's one-liner builds and runs a layer."""
    library = sorted(module_name(p) for p in PACKAGE.rglob("*.py") if (floor_of(module_name(p)) or 0) <= 1
                     and module_name(p) != "repro")
    code = textwrap.dedent(f"""
        import importlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("hydra", "omegaconf", "wandb"):
                    raise ImportError(f"{{name}} is blocked for this test")
        sys.meta_path.insert(0, Block())
        for name in {library!r}:
            importlib.import_module(name)
        import torch
        from repro.attention import LinearAttention
        layer = LinearAttention(d_model=32, n_heads=4)
        y = layer(torch.randn(2, 9, 32), causal=True)
        assert y.shape == (2, 9, 32)
        print("ok", len({library!r}))
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout[-2000:] + res.stderr[-3000:]


def module_edges(path: Path, me: str | None = None) -> tuple[set, list]:
    """(the repro modules `path` imports, at any depth, each by what it names: `from a.b import c`
    is a.b.c where that is a module, else a.b, a package's __init__; the private names it takes
    from other modules: `from m import _x` and `m._x` on an imported module)."""
    tree, edges, private, bound = ast.parse(path.read_text()), set(), [], {}

    def is_module(name):
        f = PACKAGE.parent / name.replace(".", "/")
        return f.with_suffix(".py").exists() or (f / "__init__.py").exists()

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "repro":
                    edges.add(a.name)
                    bound[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "repro":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if is_module(sub):
                    edges.add(sub)
                    bound[a.asname or a.name] = sub
                else:
                    edges.add(node.module)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(f"from {node.module} import {a.name}")
    me = me or module_name(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                and node.attr.startswith("_") and not node.attr.startswith("__") and bound[node.value.id] != me:
            private.append(f"{bound[node.value.id]}.{node.attr}")
    return edges - {me}, private


def circles(graph: dict) -> list[list]:
    """The strongly connected groups of two modules or more (each module reaches every other one
    of its group, so each is imported back by one it imports), by Tarjan's algorithm."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    """Modules sized by cohesion, not by a line count: a module split in two that reaches back
    into its other half (directly, or through others) is one module, or needs a third below both."""
    graph = {module_name(p): module_edges(p)[0] for p in PACKAGE.rglob("*.py")}
    assert not circles(graph), circles(graph)


def test_no_private_name_crosses_a_module():
    """What another module needs of a module is its public surface (no leading underscore)."""
    taken = {str(p.relative_to(REPO)): module_edges(p)[1] for p in PACKAGE.rglob("*.py")}
    assert not {k: v for k, v in taken.items() if v}, {k: v for k, v in taken.items() if v}


def test_the_circle_and_private_checks_can_fail(tmp_path):
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    bad = tmp_path / "probe.py"
    bad.write_text("from repro.kernels.plumbing.threads import _x\nfrom repro.kernels.causal_product import chunked\n"
                   "def f():\n    return chunked._y\n")
    edges, private = module_edges(bad, me="probe")
    assert "repro.kernels.causal_product.chunked" in edges and "repro.kernels.plumbing.threads" in edges
    assert private == ["from repro.kernels.plumbing.threads import _x", "repro.kernels.causal_product.chunked._y"]


@pytest.mark.slow  # builds a wheel
def test_the_package_builds_with_its_cuda_sources(tmp_path):
    """pyproject.toml: `pip install -e .` and a wheel take every package of repro/ and the kernels'
    C and CUDA sources and headers in their op and plumbing folders (built here offline, with the
    venv's own setuptools)."""
    import zipfile

    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, cwd=tmp_path)
    if res.returncode != 0 and "No module named" in res.stderr and "setuptools" in res.stderr:
        pytest.skip("no setuptools in this environment to build with")
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py")}
    assert packages <= names, sorted(packages - names)
    sources = {p.relative_to(REPO).as_posix() for p in (PACKAGE / "kernels").rglob("*")
               if p.suffix in (".c", ".h", ".cu", ".cuh")}
    assert len(sources) >= 8 and sources <= names, sorted(sources - names)


def test_the_kernel_choice_is_read_in_one_place():
    """REPRO_KERNEL is read by repro.kernels.plumbing.backend alone; every path asks it (the CPU-speed
    benchmark sets it, around the calls it times on the PyTorch pieces)."""
    import re

    read = re.compile(r"""(environ\.get\(|environ\[|getenv\()\s*["']REPRO_KERNEL""")
    readers = sorted(str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if read.search(p.read_text()))
    assert readers == ["repro/kernels/plumbing/backend.py"], readers


def test_the_kernel_switches_are_read_in_one_place():
    """REPRO_KERNEL_SWITCHES (the CUDA kernels' variants) is read by repro.kernels.plumbing.switches
    alone, and no module keeps a variant as a global of its own that callers patch."""
    import re

    read = re.compile(r"""(environ\.get\(|environ\[|getenv\()\s*(["']REPRO_KERNEL_SWITCHES|ENV\b)""")
    readers = sorted(str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if read.search(p.read_text()))
    assert readers == ["repro/kernels/plumbing/switches.py"], readers
    patched = re.compile(r"^(GPU_VERIFIED|TENSOR_CORES|BARE_SMEM|VEC_LOADS|STAGED|PREFILL)\s*=", re.M)
    assert not [str(p) for p in PACKAGE.rglob("*.py") if patched.search(p.read_text())]


# repro/kernels/: one folder per op family, and the plumbing they share; nothing else but the
# package's own __init__ (the ops and their dispatcher)
KERNEL_FOLDERS = ("causal_product", "normalised", "gated", "delta", "recurrent", "plumbing")


def misplaced_kernel_files(kernels: Path) -> list[str]:
    """The files under `kernels` that sit in no op folder nor the plumbing folder."""
    return sorted(p.relative_to(kernels).as_posix() for p in kernels.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.relative_to(kernels).as_posix() != "__init__.py"
                  and p.relative_to(kernels).parts[0] not in KERNEL_FOLDERS)


def test_every_kernel_module_lives_in_an_op_folder_or_the_plumbing(tmp_path):
    kernels = PACKAGE / "kernels"
    assert not misplaced_kernel_files(kernels)
    assert all((kernels / f / "__init__.py").exists() for f in KERNEL_FOLDERS)
    assert sorted(p.name for p in kernels.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(KERNEL_FOLDERS)
    # the check fails on a flat layout: modules and sources beside the package's __init__
    flat = tmp_path / "kernels"
    (flat / "plumbing").mkdir(parents=True)
    for name in ("__init__.py", "chunked.py", "causal_dot.cu", "plumbing/threads.py"):
        (flat / name).write_text("")
    assert misplaced_kernel_files(flat) == ["causal_dot.cu", "chunked.py"]


# tests/ mirrors the package: the tests of repro/<a>/<b> in tests/<a>/<b>/, the cross-cutting ones at the root
# beside the shared helpers; tests/extending/ holds docs/extending.md's examples, no tests of the suite
TEST_HELPER_FOLDERS = ("extending",)


def unmirrored_test_folders(tests: Path, package: Path) -> list[str]:
    """The folders under `tests` holding a module (helpers' aside) with no package at the same place under `package`."""
    folders = {p.parent.relative_to(tests) for p in tests.rglob("*.py") if p.parent != tests}
    return sorted(f.as_posix() for f in folders if f.parts[0] not in TEST_HELPER_FOLDERS
                  and "__pycache__" not in f.parts and not (package / f / "__init__.py").is_file())


def test_every_test_folder_mirrors_a_package(tmp_path):
    assert not unmirrored_test_folders(REPO / "tests", PACKAGE)
    # tests/foo/ with no repro/foo/ fails the check, and so does tests/kernels/foo/ with no repro/kernels/foo/
    (tmp_path / "repro" / "kernels").mkdir(parents=True)
    (tmp_path / "repro" / "kernels" / "__init__.py").write_text("")
    for name in ("test_a.py", "kernels/test_a.py", "foo/test_a.py", "kernels/foo/test_a.py", "extending/toy.py"):
        (tmp_path / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / name).write_text("")
    assert unmirrored_test_folders(tmp_path / "tests", tmp_path / "repro") == ["foo", "kernels/foo"]
