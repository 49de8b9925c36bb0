"""The fused CPU kernel's build cache (repro/kernels/plumbing/cpu_build.py): a cached library is loaded only
when it is whole, for this machine, holds the entry points and is this user's alone; anything else
is rebuilt with one line on stderr, or refused, never a crash. Its name tells CPUs and compilers
apart. The compiler here is a stand-in that copies one really built library (so one real build in
all), and REPRO_KERNEL's errors are one line through run.py."""
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from run_cli import ENV, SMOKE_COPY, run_py

from repro.common.errors import ConfigError
from repro.common.results import REPO
from repro.kernels.causal_product import cpu_native
from repro.kernels.plumbing import backend, cpu_build


@pytest.fixture(scope="module")
def built() -> bytes:
    if cpu_native.unavailable():
        pytest.skip(f"the fused CPU kernel does not build here: {cpu_native.unavailable()}")
    return Path(cpu_native.library()._name).read_bytes()


def _compiler(cc: Path, body: str, version="stand-in cc 1"):
    """A shell script standing in for cc: `--version` prints `version`, a build logs itself and
    runs `body` with $out the -o argument."""
    cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "{version}"; exit 0; }}\n'
                  f"echo >> {shlex.quote(str(cc))}.log\n"
                  f'while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n{body}\n')
    cc.chmod(0o755)


@pytest.fixture
def cache(monkeypatch, tmp_path, built):
    """A fresh process's view: nothing loaded, the cache folder and the private one ($TMPDIR's)
    under tmp_path, and a compiler that writes the built library."""
    (tmp_path / "built.so").write_bytes(built)
    cc = tmp_path / "cc"
    _compiler(cc, f'cat {shlex.quote(str(tmp_path / "built.so"))} > "$out"')
    (tmp_path / "tmp").mkdir(mode=0o700)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("REPRO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # for child processes; tempdir for this one
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.delenv("REPRO_KERNEL", raising=False)
    monkeypatch.setattr(cpu_native, "_LIB", [])
    log = Path(f"{cc}.log")
    return SimpleNamespace(dir=tmp_path / "cache", cc=cc, private=tmp_path / "tmp" / f"repro-kernels-{os.getuid()}",
                           compiles=lambda: len(log.read_text().splitlines()) if log.exists() else 0)


def _load():
    """library() as a new process calls it."""
    cpu_native._LIB.clear()
    return cpu_native.library()


def _replace(lib: Path, data: bytes):
    """A new file in lib's place: writing into the loaded one would change this process's mapping."""
    new = lib.with_name("new")
    new.write_bytes(data)
    os.replace(new, lib)


def _other_machine(lib: Path):
    data = bytearray(lib.read_bytes())
    data[18] = 183 if data[18] != 183 else 62  # e_machine (its low byte): aarch64, else x86-64
    _replace(lib, bytes(data))


def _symlink(lib: Path):
    lib.unlink()
    lib.symlink_to(lib.parent.parent / "built.so")


def _other_owner(lib: Path, monkeypatch):
    """os.lstat says someone else owns `lib` (chown needs root)."""
    real = os.lstat

    def lstat(path, *a, **kw):
        st = real(path, *a, **kw)
        return os.stat_result((*st[:4], st.st_uid + 1, *st[5:10])) if Path(path) == lib else st
    monkeypatch.setattr(os, "lstat", lstat)


DAMAGE = {
    "empty (0 bytes)": lambda lib, mp: _replace(lib, b""),
    "lacks linear_elu_backward": lambda lib, mp: _replace(
        lib, lib.read_bytes().replace(b"linear_elu_backward\0", b"linear_elu_backwarX\0")),
    "not an ELF file": lambda lib, mp: _replace(lib, b"#!/bin/sh\necho hello\n"),
    "built for another machine": lambda lib, mp: _other_machine(lib),
    "writable by its group": lambda lib, mp: lib.chmod(0o775),
    "writable by others": lambda lib, mp: lib.chmod(0o757),
    "writable by its group and others": lambda lib, mp: lib.chmod(0o777),
    "not a regular file": lambda lib, mp: _symlink(lib),
    "owned by uid": _other_owner,
}


@pytest.mark.parametrize("why", DAMAGE)
def test_a_bad_cached_library_is_rebuilt(cache, built, capsys, monkeypatch, why):
    """Each is rebuilt in place, with one line naming the file and why; the old code loaded the
    writable and foreign ones as they were and failed (or raised) on the rest."""
    assert _load() is not None and cache.compiles() == 1
    (lib,) = cache.dir.iterdir()
    DAMAGE[why](lib, monkeypatch)
    capsys.readouterr()
    assert _load() is not None, cpu_native.unavailable()
    assert cache.compiles() == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kernel cache: rebuilding {lib}: {why}"), lines
    assert lib.read_bytes() == built and not lib.is_symlink() and not lib.stat().st_mode & 0o022


@pytest.mark.slow  # one real build of the C source
def test_a_truncated_library_is_rebuilt_not_a_sigbus(cache, built):
    """A library cut short used to kill every later process with SIGBUS inside dlopen, without a
    word; now the file is read first, and rebuilt. Run in child processes: the old code's crash."""
    code = "from repro.kernels.causal_product import cpu_native; print(cpu_native.unavailable())"
    run = lambda: subprocess.run([sys.executable, "-c", code], cwd=REPO, env=os.environ.copy(),
                                 capture_output=True, text=True, timeout=300)
    first = run()
    assert (first.returncode, first.stdout.strip()) == (0, "None"), first.stderr
    (lib,) = cache.dir.iterdir()
    _replace(lib, built[:len(built) * 3 // 5])
    second = run()
    assert (second.returncode, second.stdout.strip()) == (0, "None"), (second.returncode, second.stderr[-2000:])
    assert second.stderr.splitlines() == [f"kernel cache: rebuilding {lib}: cut short ({len(built) * 3 // 5} "
                                          "bytes; its headers reach past the end)"]
    assert lib.read_bytes() == built and cache.compiles() == 2


@pytest.mark.parametrize("body, why", [("exit 0", "empty (0 bytes)"),
                                       ('head -c 3000 "$out.src" > "$out"', "cut short (3000 bytes")])
def test_a_compiler_that_writes_no_library_leaves_nothing(cache, tmp_path, body, why):
    """A compiler that exits 0 having written nothing (or part): the old code renamed its empty
    output into the cache, where it stayed, failing every later load; now nothing is kept and the
    next build goes through."""
    _compiler(cache.cc, body.replace("$out.src", shlex.quote(str(tmp_path / "built.so"))))
    assert _load() is None
    assert f"exited 0 but wrote no usable library: {why}" in cpu_native.unavailable()
    assert list(cache.dir.iterdir()) == []
    _compiler(cache.cc, f'cat {shlex.quote(str(tmp_path / "built.so"))} > "$out"')
    assert _load() is not None and cache.compiles() == 2


@pytest.mark.parametrize("mode, who", [(0o777, "its group and others"), (0o770, "its group"), (0o1703, "others")])
def test_a_cache_folder_others_can_write_to_is_left_alone(cache, capsys, mode, who):
    """A library in a folder someone else can write to could be theirs: the old code loaded the one
    found there; now it is built in the private folder (mode 0700), with one line saying so."""
    assert _load() is not None and cache.compiles() == 1
    cache.dir.chmod(mode)
    capsys.readouterr()
    lib = _load()
    assert lib is not None and cache.compiles() == 2
    assert Path(lib._name).parent == cache.private and cache.private.stat().st_mode & 0o777 == 0o700
    assert capsys.readouterr().err.splitlines() == [
        f"kernel cache: not using the cache folder {cache.dir} (writable by {who}; make it yours with chmod go-w, "
        f"or set REPRO_CACHE_DIR); building in {cache.private}"]


def test_no_folder_of_ones_own_means_no_kernel(cache, monkeypatch):
    """Every folder owned by someone else (here: this user seen as another uid): nothing loaded or
    built, the reason named, and the PyTorch pieces run."""
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)
    assert _load() is None and cache.compiles() == 0
    assert cpu_native.unavailable() == (f"no cache folder of this user's own to build in: {cache.private.parent}/"
                                        f"repro-kernels-{me + 1} is owned by uid {me}, not this user ({me + 1})")


ARM = ("processor\t: {i}\nBogoMIPS\t: 50.00\nFeatures\t: {features}\nCPU implementer\t: 0x41\n"
       "CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: {part}\nCPU revision\t: 1\n\n")
X86 = "processor\t: {i}\nvendor_id\t: AuthenticAMD\nmodel name\t: {model}\ncpu MHz\t\t: {mhz}\nflags\t\t: {flags}\n\n"


def test_the_name_tells_cpus_apart(monkeypatch):
    """-march=native code is for one CPU: ARM's /proc/cpuinfo has no "model name" or "flags" (the
    old key's only fields, so every ARM CPU shared one name); its implementer, part and features
    count now, x86's model and flags as before (not the clock), and the platform's names where
    /proc/cpuinfo says nothing."""
    read_text, fake = Path.read_text, []
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **kw: (
        fake[-1] if self == Path("/proc/cpuinfo") else read_text(self, *a, **kw)))

    def model(*cpus):
        fake.append("".join(c.replace("{i}", str(i)) for i, c in enumerate(cpus)))
        return cpu_build._cpu_model()
    n1 = ARM.replace("{features}", "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics").replace("{part}", "0xd0c")
    v1 = ARM.replace("{features}", "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics sve").replace("{part}", "0xd40")
    n1_no_aes = n1.replace(" aes pmull", "")
    a55 = ARM.replace("{features}", "fp asimd").replace("{part}", "0xd05")
    arm = [(n1, n1), (v1, v1), (n1_no_aes,), (n1, a55)]  # a big.LITTLE chip lists both its cores
    assert len({model(*cpus) for cpus in arm}) == 4
    assert "CPU part: 0xd0c" in model(n1, a55) and "CPU part: 0xd05" in model(n1, a55)
    epyc = X86.replace("{model}", "AMD EPYC 9654").replace("{flags}", "fpu sse avx2 avx512f")
    x86 = [model(epyc.replace("{mhz}", "2400.0")), model(epyc.replace("{mhz}", "3701.2")),
           model(epyc.replace("{mhz}", "2400.0").replace(" avx512f", ""))]
    assert x86[0] == x86[1] != x86[2]
    assert model("") == f"{platform.machine()}\n{platform.processor()}"
    keys = set()
    for cpus in arm:
        model(*cpus)
        keys.add(cpu_build._key(sys.executable, cpu_native.SOURCES, cpu_native.FLAGS))
    assert len(keys) == 4


def test_the_name_covers_the_compilers_version(cache):
    key = cpu_build._key(str(cache.cc), cpu_native.SOURCES, cpu_native.FLAGS)
    _compiler(cache.cc, "exit 1", version="stand-in cc 2")
    cpu_build._compiler_version.cache_clear()
    assert cpu_build._key(str(cache.cc), cpu_native.SOURCES, cpu_native.FLAGS) != key


def test_repro_kernel_errors_are_config_errors(monkeypatch):
    """ConfigError (a ValueError) for a bad value, and also a RuntimeError for a backend that
    cannot run, as library callers caught them before."""
    monkeypatch.setenv("REPRO_KERNEL", "bogus")
    with pytest.raises(ConfigError, match="REPRO_KERNEL='bogus' is not a backend; valid: cupy, cpu, torch"):
        backend.forced_backend()
    assert issubclass(ConfigError, ValueError)
    assert issubclass(backend.BackendUnavailable, ConfigError) and issubclass(backend.BackendUnavailable, RuntimeError)


@pytest.mark.slow
@pytest.mark.parametrize("setting, line", [
    ({"REPRO_KERNEL": "bogus"}, "error: REPRO_KERNEL='bogus' is not a backend; valid: cupy, cpu, torch"),
    ({"REPRO_KERNEL": "cpu", "CC": "/no/such/cc"},
     "error: REPRO_KERNEL=cpu, but the fused CPU kernel is unavailable: building causal_dot_cpu with /no/such/cc "
     "failed: FileNotFoundError: ")])
def test_repro_kernel_errors_are_one_line_through_run_py(tmp_path, setting, line):
    """The old code ended both in Hydra's traceback of the first forward (exit 1)."""
    env = {**ENV, "REPRO_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp_path), **setting}
    proc = run_py(*SMOKE_COPY, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr
