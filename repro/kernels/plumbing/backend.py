"""The one place the kernel backend choice is read: REPRO_KERNEL=torch|cupy|cpu forces one for
every path (the causal product, the fused attention and the recurrent step); unset, the dispatcher
(repro.kernels) picks per input. torch: plain PyTorch everywhere (the fused CPU kernel off too);
cpu: the fused CPU kernel must build and take the inputs (CUDA inputs are an error). A bad value,
or a forced backend that cannot run, is the user's setting to fix: a ConfigError, one line under
run.py."""
import os
from contextlib import contextmanager

from repro.common.errors import ConfigError

BACKENDS = ("cupy", "cpu", "torch")


class BackendUnavailable(ConfigError, RuntimeError):
    """REPRO_KERNEL forces a backend that cannot run these inputs here (a RuntimeError as well, as
    library callers have caught it)."""


def forced_backend() -> str | None:
    """The backend REPRO_KERNEL forces, or None; an unknown value is a one-line error."""
    forced = os.environ.get("REPRO_KERNEL", "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ConfigError(f"REPRO_KERNEL={forced!r} is not a backend; valid: {', '.join(BACKENDS)}")
    return forced or None


@contextmanager
def forcing(backend: str):
    """REPRO_KERNEL=backend inside the block (for timing one backend against another in one
    process), restored after."""
    if backend not in BACKENDS:
        raise ValueError(f"forcing({backend!r}): not a backend; valid: {', '.join(BACKENDS)}")
    old = os.environ.get("REPRO_KERNEL")
    os.environ["REPRO_KERNEL"] = backend
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("REPRO_KERNEL", None)
        else:
            os.environ["REPRO_KERNEL"] = old
