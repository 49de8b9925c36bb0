"""Build and load a C shared library on first use, through a cache that cannot crash or subvert
the process (repro.kernels.causal_product.cpu_native's fused kernels are built here).

    load(stem, sources, headers, flags, symbols) -> (ctypes.CDLL, None) or (None, why not)

The library is compiled by the C compiler on the PATH (cc, gcc or $CC) into $REPRO_CACHE_DIR
(default ~/.cache/repro/kernels) as <stem>-<key>.so, the key a hash of the sources, the flags, the
compiler and its version, and this CPU's model and features (-march=native code must not meet
another CPU). A library runs with its loader's rights, and one cut short kills the process with
SIGBUS inside dlopen, so a cached file is loaded only when this user owns it and its folder, no one
else can write to either, and it is a whole ELF shared library for this process's machine defining
`symbols`, all read from the file before dlopen; any other file is rebuilt, with one line on stderr
saying why. A folder that fails the check is left alone: the library is built in a private one
($TMPDIR/repro-kernels-<uid>, mode 0700) instead, also with one line. The compiler writes a
temporary file, checked the same way, then renamed into place (atomic: parallel workers may build
at once), so the cache never holds an empty or part-written library.
"""
import ctypes
import hashlib
import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

# /proc/cpuinfo's fields that say what -march=native compiles for: x86's model and flags, ARM's
# implementer, part and features, POWER's cpu, RISC-V's isa and uarch, s390's features.
CPU_FIELDS = ("model name", "flags", "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features",
              "cpu", "isa", "uarch", "features")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_model() -> str:
    """This CPU's machine, model and features: each distinct CPU_FIELDS line of /proc/cpuinfo (a
    big.LITTLE chip lists two models), else what platform says."""
    fields = (ln.partition(":") for ln in _cpuinfo().splitlines())
    lines = sorted({f"{k.strip()}: {v.strip()}" for k, _, v in fields if k.strip() in CPU_FIELDS})
    return "\n".join([platform.machine(), *(lines or [platform.processor()])])


@cache
def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""  # the build then fails and says why


def _key(cc: str, files, flags) -> str:
    """A hash of what the library's machine code depends on."""
    parts = [Path(f).read_bytes() for f in files] + [s.encode() for s in (" ".join(flags), cc, _compiler_version(cc),
                                                                         _cpu_model())]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _elf_header(data: bytes):
    """(byte order, 64-bit, the header's fields from e_type on) of an ELF file's first bytes, or None."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        return None
    end, wide = "<>"[data[5] - 1], data[4] == 2
    return end, wide, struct.unpack_from(end + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH"), data, 16)


def _this_machine():
    """(byte order, 64-bit, e_machine) of this process's program, or None where it is no ELF file."""
    try:
        with open(os.path.realpath(sys.executable) if sys.executable else "/proc/self/exe", "rb") as f:
            head = _elf_header(f.read(64))
    except OSError:
        return None
    return head and (head[0], head[1], head[2][1])


def _elf_problem(data: bytes, symbols) -> str | None:
    """Why `data` is not a whole ELF shared library for this process defining `symbols`, or None.
    Every segment dlopen maps must lie inside the file: a page past its end is a SIGBUS."""
    if not data:
        return "empty (0 bytes)"
    own = _this_machine()
    if own is None:
        return None  # not an ELF platform: its size is all there is to check
    head = _elf_header(data)
    if head is None:
        return "not an ELF file"
    end, wide, (e_type, machine, _, _, phoff, shoff, _, _, phsize, phnum, shsize, shnum, _) = head
    if (end, wide, machine) != own:
        return f"built for another machine (ELF machine {machine}, {64 if wide else 32}-bit; this one: {own[2]})"
    if e_type != 3:
        return "not a shared library"
    ph, sh = (struct.Struct(end + f) for f in (("IIQQQQQQ", "IIQQQQIIQQ") if wide else ("8I", "10I")))
    if phsize != ph.size or shsize != sh.size or not phnum or not shnum:
        return "malformed (no program or section headers)"
    size = len(data)
    if max(phoff + phnum * ph.size, shoff + shnum * sh.size) > size:
        return f"cut short ({size} bytes; its headers reach past the end)"
    segs = [ph.unpack_from(data, phoff + i * ph.size) for i in range(phnum)]
    secs = [sh.unpack_from(data, shoff + i * sh.size) for i in range(shnum)]
    extents = [(s[2], s[5]) if wide else (s[1], s[4]) for s in segs] + [(s[4], s[5]) for s in secs if s[1] != 8]
    if any(off + n > size for off, n in extents):  # sh_type 8: NOBITS, nothing in the file
        return f"cut short ({size} bytes; a segment or section reaches past the end)"
    sym, names = struct.Struct(end + ("IBBHQQ" if wide else "IIIBBH")), set()
    for s in secs:
        if s[1] != 11 or s[6] >= shnum:  # SHT_DYNSYM, its string table's index in sh_link
            continue
        strings = secs[s[6]][4]
        for i in range(s[5] // sym.size):
            f = sym.unpack_from(data, s[4] + i * sym.size)
            name, info, shndx = (f[0], f[1], f[3]) if wide else (f[0], f[3], f[5])
            if shndx and info & 0xF == 2:  # defined functions
                start = strings + name
                names.add(data[start:data.find(b"\0", start)].decode(errors="replace"))
    missing = [s for s in symbols if s not in names]
    return f"lacks {', '.join(missing)}" if missing else None


def _not_private(st) -> str | None:
    """Why a file or folder with this stat could hold someone else's code, or None."""
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if who := [w for bit, w in ((0o020, "its group"), (0o002, "others")) if st.st_mode & bit]:
        return f"writable by {' and '.join(who)}"
    return None


def _unusable(lib: Path, symbols) -> str | None:
    """Why the cached `lib` must not be loaded, or None."""
    st = os.lstat(lib)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return _not_private(st) or _elf_problem(lib.read_bytes(), symbols)


def _say(line: str):
    print(f"kernel cache: {line}", file=sys.stderr, flush=True)


def _cache_dir() -> tuple:
    """(the folder to build in, None) or (None, why there is none): $REPRO_CACHE_DIR (default
    ~/.cache/repro/kernels) when this user owns it and no one else can write to it, else a private
    one, made with mode 0700."""
    shared = Path(os.environ.get("REPRO_CACHE_DIR") or Path.home() / ".cache" / "repro" / "kernels")
    private = Path(tempfile.gettempdir()) / f"repro-kernels-{os.getuid()}"
    for folder in dict.fromkeys((shared, private)):
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            why = _not_private(folder.stat())
        except OSError as err:
            why = f"cannot be made: {err.strerror or err}"
        if why is None:
            return folder, None
        if folder != private:
            _say(f"not using the cache folder {folder} ({why}; make it yours with chmod go-w, or set REPRO_CACHE_DIR); "
                 f"building in {private}")
    return None, f"no cache folder of this user's own to build in: {private} is {why}"


def _compile(cc: str, lib: Path, sources, flags, symbols) -> str | None:
    """Build into a temporary file beside `lib`, check it, rename it into place; None, or why not."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=lib.stem + "-", suffix=".tmp", dir=lib.parent)
        os.close(fd)
        res = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources)], capture_output=True, text=True,
                             timeout=120)
        if res.returncode:
            last = (res.stderr.strip().splitlines() or ["?"])[-1]
            return f"{Path(cc).name} failed on {', '.join(Path(f).name for f in sources)}: {last}"
        if why := _elf_problem(Path(tmp).read_bytes(), symbols):
            return f"{Path(cc).name} exited 0 but wrote no usable library: {why}"
        os.chmod(tmp, 0o755)  # not the umask's: no one else may write to it
        os.replace(tmp, lib)
        tmp = None
    except (OSError, subprocess.SubprocessError) as err:
        return f"building {lib.stem.rsplit('-', 1)[0]} with {cc} failed: {type(err).__name__}: {err}"
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return None


def load(stem: str, sources, headers, flags, symbols) -> tuple:
    """(the library built from `sources` (and `headers`) with `flags`, None), or (None, why not)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler on the PATH (cc, gcc or $CC)"
    cache, why = _cache_dir()
    if cache is None:
        return None, why
    lib, why = cache / f"{stem}-{_key(cc, [*sources, *headers], flags)}.so", "not built yet"
    if os.path.lexists(lib):
        try:
            why = _unusable(lib, symbols)
        except OSError as err:
            why = f"unreadable: {err.strerror or err}"
        if why:
            _say(f"rebuilding {lib}: {why}")
    if why and (failed := _compile(cc, lib, sources, flags, symbols)):
        return None, failed
    try:
        return ctypes.CDLL(str(lib)), None
    except OSError as err:
        return None, f"loading {lib} failed: {err}"
