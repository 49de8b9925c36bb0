"""The one place the kernel backend choice is read: REPRO_KERNEL=torch|cupy forces one for every
path (the causal product, the fused attention and the recurrent step); unset, the dispatcher
(repro.kernels) picks per input."""
import os

BACKENDS = ("cupy", "torch")


def forced_backend() -> str | None:
    """The backend REPRO_KERNEL forces, or None; an unknown value is a one-line error."""
    forced = os.environ.get("REPRO_KERNEL", "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"REPRO_KERNEL={forced!r} is not a backend; valid: {', '.join(BACKENDS)}")
    return forced or None
