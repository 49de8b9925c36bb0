"""The CUDA sources of the CuPy backend, their template instances, and how they are compiled.

Each .cu file of an op folder (named here by its path under repro/kernels/) is compiled at first
use by cupy.RawModule (NVRTC, for the GPU in use; CuPy caches the binary on disk) with the
instances named here. `nvrtc_check`
compiles the same source and instances for a given architecture without a GPU or driver, which
is what the CPU tests use so that a kernel that does not compile cannot land.
"""
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # repro/kernels/: the sources' paths start here
OPTIONS = ("-std=c++17",)
DTYPES = ("float", "bf16_t", "f16_t")  # kernel-side names of fp32, bf16, fp16


def _bool(b):
    return "true" if b else "false"


# Every template instance the Python side launches: (file, [name expressions]).
SOURCES = {
    "causal_product/causal_dot.cu": [f"{kern}<{t},{_bool(rev)},{_bool(norm)}>"
                      for kern in ("cdp_group_states", "cdp_chunks") for t in DTYPES
                      for rev, norm in ((False, False), (True, False), (False, True))]
                     + ["cdp_scan_states"],
    "causal_product/causal_dot_tc.cu": [f"{kern}<bf16_t,{_bool(rev)},{_bool(norm)}>"
                         for kern in ("cdp_group_states_tc", "cdp_chunks_tc")
                         for rev, norm in ((False, False), (True, False), (False, True))],
    "causal_product/causal_dot_tc_staged.cu": [f"{kern}<bf16_t,{_bool(rev)}>" for kern in ("cdp_group_states_tc_staged",
                                                                             "cdp_chunks_tc_staged")
                                for rev in (False, True)],
    "recurrent/recurrent_step.cu": [f"linear_step<{t}>" for t in DTYPES],
}
PRELUDE = "plumbing/dtypes.cuh"  # prepended to every source: the 16-bit types and their conversions
# Sources another one builds on, compiled before it in its module (only the instances named in
# SOURCES are compiled, so the templates it borrows cost nothing more).
REQUIRES = {"causal_product/causal_dot_tc_staged.cu": ("causal_product/causal_dot_tc.cu",)}


def source(name: str) -> str:
    """The text NVRTC compiles: the prelude, the files `name` requires, then the file."""
    return (ROOT / PRELUDE).read_text() + "".join(
        f'#line 1 "{part}"\n' + (ROOT / part).read_text() for part in (*REQUIRES.get(name, ()), name))


def _nvrtc_compile(name: str, arch: str, *options) -> tuple[str, dict]:
    """(the compiler's log, {instance: lowered name}) of `name` compiled for `arch` with NVRTC.
    Raises RuntimeError with the log on failure."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source(name), name, [], [])
    try:
        for expr in SOURCES[name]:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *options, *OPTIONS])
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}: {err}\n"
                               f"{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getProgramLog(prog), {expr: nvrtc.getLoweredName(prog, expr) for expr in SOURCES[name]}
    finally:
        nvrtc.destroyProgram(prog)


def nvrtc_check(name: str, arch: str) -> dict:
    """Compile `name` for `arch` (e.g. "sm_90") with NVRTC; {instance: lowered name}.
    Raises RuntimeError with the compiler log on failure."""
    return _nvrtc_compile(name, arch)[1]


def ptxas_usage(name: str, arch: str) -> dict:
    """{instance: (registers per thread, spill bytes)} of `name` compiled for `arch` by NVRTC's
    ptxas, which says how many blocks of a kernel fit an SM before any GPU runs it."""
    log, lowered = _nvrtc_compile(name, arch, "--ptxas-options=-v")
    instance = {low: expr for expr, low in lowered.items()}
    usage = {}  # ptxas names each entry, then its spills, then its registers
    for entry, spills, regs in re.findall(r"entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers",
                                          log, re.S):
        usage[instance.get(entry, entry)] = (int(regs), int(spills))
    return usage


def nvcc_instantiation_unit(name: str) -> str:
    """A translation unit for nvcc that includes `name` and takes the address of every
    instance, so nvcc compiles each one as the NVRTC build does."""
    refs = ",\n    ".join(f"(const void*)&{expr}" for expr in SOURCES[name])
    includes = "".join(f'#include "{ROOT / part}"\n' for part in (PRELUDE, *REQUIRES.get(name, ()), name))
    return (includes +
            f'const void* repro_instances[] = {{\n    {refs}\n}};\n')


@cache
def module(name: str, device_index: int):
    """The compiled cupy.RawModule of `name` for one GPU (compiled for that GPU's arch)."""
    import cupy

    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=source(name), options=OPTIONS, name_expressions=SOURCES[name])
