"""The CuPy kernels' switches: which variant of a kernel a launch takes, set in one place.

    REPRO_KERNEL_SWITCHES=staged,vec_loads      names turn a switch on, no_<name> turns it off

    switch        default  what it does (docs/kernels.md)
    gpu_verified  on       unforced, the dispatcher may take the CuPy kernels; off, only
                           REPRO_KERNEL=cupy runs them. On since the GPU kernel tests passed on
                           an NVIDIA H100 80GB HBM3 (88, none skipped, commit 239c217;
                           results/gpu/NVIDIA_H100_80GB_HBM3/env/); verify another GPU with
                           REPRO_KERNEL=cupy python -m pytest -q -rs tests/kernels/test_cupy_kernels.py
    tensor_cores  on       bf16 products on tensor cores (causal_dot_tc.cu)
    bare_smem     off      the bare tensor-core product asks only the shared memory it uses
    vec_loads     off      the tensor-core kernel loads Q and K 16 bytes a thread
    staged        off      the bare bf16 product by the pipelined kernel (causal_dot_tc_staged.cu)
    prefill_nan   off      every kernel output pre-filled with NaN, so that an element no thread
                           writes shows up (the GPU tests)

A program sets them for a block with `with switched(staged=True): ...` (or `switched("staged")`);
launches read `current()`. The override is process-wide, not per thread: autograd runs a CUDA
backward on a thread of its own, which must see the forward's switches.
"""
import os
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import lru_cache

from repro.common.errors import ConfigError

ENV = "REPRO_KERNEL_SWITCHES"


@dataclass(frozen=True)
class Switches:
    gpu_verified: bool = True
    tensor_cores: bool = True
    bare_smem: bool = False
    vec_loads: bool = False
    staged: bool = False
    prefill_nan: bool = False


NAMES = tuple(f.name for f in fields(Switches))


DEFAULTS = Switches()


def parse(text: str, base: Switches = DEFAULTS) -> Switches:
    """`base` with the comma-separated switches of `text` set (any case; no_<name>: off); an
    unknown name is a one-line ConfigError naming it and the valid ones."""
    changes = {}
    for token in filter(None, (t.strip().lower() for t in text.split(","))):
        name, on = (token[3:], False) if token.startswith("no_") else (token, True)
        if name not in NAMES:
            raise ConfigError(f"{ENV}: {token!r} is not a kernel switch; valid: {', '.join(NAMES)} "
                              f"(no_<name> turns one off)")
        changes[name] = on
    return replace(base, **changes)


_from_text = lru_cache(maxsize=16)(parse)  # a launch reads the variable; parsing it once per value


def from_env() -> Switches:
    """The switches REPRO_KERNEL_SWITCHES sets (the one place it is read)."""
    return _from_text(os.environ.get(ENV, ""))


_override: Switches | None = None


def current() -> Switches:
    """What a launch takes: the innermost `switched` block's switches, else the environment's."""
    return _override or from_env()


@contextmanager
def switched(text: str = "", **changes: bool):
    """current() with the switches named in `text` (as REPRO_KERNEL_SWITCHES) and `changes` set,
    inside the block; restored after."""
    global _override
    if bad := sorted(set(changes) - set(NAMES)):
        raise ConfigError(f"switched: {bad[0]!r} is not a kernel switch; valid: {', '.join(NAMES)}")
    was, _override = _override, replace(parse(text, current()), **changes)
    try:
        yield _override
    finally:
        _override = was
