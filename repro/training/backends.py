"""Which kernel an attention layer runs its causal sums on, for the rows of every timing (the
benchmark, the generation throughput, the kernels task, training steps): a timing means little
without it, since the fused C kernel and the PyTorch path differ by several times at small sizes.

    layer_backend(layer, batch, n, dtype, device, causal) -> {"kernel_backend": name, "kernel_backend_why": why,
                                                              "kernel_fallback": bool}

name: "cpu" (the fused C kernels: the linear layer's fused CPU layer, repro.kernels.normalised.cpu_layer, or
the causal product's C kernel), "cupy" (the CUDA kernels) or "torch" (PyTorch operations); why: the
path taken and, for "torch" where a kernel exists for such inputs (kernel_fallback), why none was
taken (the dispatcher's own words: no C compiler, REPRO_KERNEL=torch, ...). The layer's own
choices are asked in the order the layer asks them (repro.attention.linear: the fused CUDA attention, the fused CPU
layer, the normalised path's C product, the dispatcher), on stand-in tensors of the real shapes
that hold no memory (tests/training/test_backends.py checks the answer against the calls a pass makes).
note_fallback prints, once per run and attention, that a run took the PyTorch path instead.
"""
import sys

import torch

_NOTED: set = set()


def _stand_in(shape, dtype, device, grad):
    """A tensor of this shape, dtype and device that holds one element (an expanded scalar)."""
    return torch.empty((), dtype=dtype, device=device, requires_grad=grad).expand(shape)


def _dispatcher(q, k, v, acc, wide=False) -> tuple[str, str, bool]:
    """What repro.kernels.causal_dot_product takes for these inputs (wide: asked for sums in acc,
    wider than the inputs), and whether that is the PyTorch path where a kernel exists."""
    from repro.kernels import WIDE_SUMS, product_backend

    if q.device.type == "cpu" and acc == torch.float64:
        return "torch", "float64: the fused CPU kernel sums in fp32 only", False
    name, why = product_backend(q, k, v, out_dtype=acc if wide else None)
    if why == WIDE_SUMS:  # the chunked path by choice: not a fallback
        return name, why, False
    if name != "torch" and not why.startswith("forced"):
        why = "the fused C kernel of the causal product" if name == "cpu" else "the CUDA causal product"
    return name, why, name == "torch"


def _linear(layer, batch, n, dtype, device, grad) -> tuple[str, str, bool]:
    from repro.kernels import cupy_for
    from repro.kernels.causal_product import cpu_native
    from repro.kernels.normalised import cpu_layer
    from repro.kernels.plumbing.dtypes import accumulation_dtype

    acc = accumulation_dtype(dtype)
    h, d, m = layer.n_heads, layer.d_keys, layer.d_values
    q, v = _stand_in((batch, h, n, d), dtype, device, grad), _stand_in((batch, h, n, m), dtype, device, grad)
    with torch.no_grad():
        f = layer.feature_map(torch.zeros(1, 1, 1, d, dtype=dtype, device=device)).shape[-1]
    trainable_map = any(p.requires_grad for p in layer.feature_map.parameters())
    if trainable_map or cupy_for("normalised", q, q, v):
        # the differentiable formula (repro.kernels.normalised): the fused CUDA attention on phi,
        # else the dispatcher on [v, 1] with sums in acc
        phi = _stand_in((batch, h, n, f), dtype, device, grad)
        if cupy_for("normalised", phi, phi, v):
            return "cupy", "the fused CUDA kernel of the normalised linear attention", False
        return _dispatcher(phi, phi, _stand_in((batch, h, n, m + 1), dtype, device, grad), acc, wide=acc != dtype)
    if cpu_layer.applies(q, q, v, True, layer.feature_map):
        return "cpu", "the fused CPU layer (phi = elu + 1, fp32; repro.kernels.normalised.cpu_layer)", False
    if cpu_native.native(device, acc):
        return "cpu", "the fused C kernel of the causal product (repro.kernels.normalised.blocked)", False
    phi = _stand_in((batch, h, n, f), acc, device, grad)  # the normalised path: phi and [v, 1] in acc
    return _dispatcher(phi, phi, _stand_in((batch, h, n, m + 1), acc, device, grad), acc)


def _rfa(layer, batch, n, dtype, device, grad) -> tuple[str, str, bool]:
    from repro.kernels.plumbing.dtypes import accumulation_dtype

    if layer.gated:
        return "torch", "the gated product's chunked PyTorch path (no fused kernel for it)", False
    acc = accumulation_dtype(dtype)
    h, f, m = layer.n_heads, 2 * layer.n_features, layer.d_values
    phi = _stand_in((batch, h, n, f), acc, device, grad)
    return _dispatcher(phi, phi, _stand_in((batch, h, n, m + 1), acc, device, grad), acc)


def _fields(name, why, fallback) -> dict:
    return {"kernel_backend": name, "kernel_backend_why": why, "kernel_fallback": fallback}


def layer_backend(layer, batch: int, n: int, dtype, device, causal: bool = True, grad: bool = True) -> dict:
    """The row fields naming the kernel `layer` runs for input (batch, n, d_model) in dtype on
    device, forward and, with grad, backward (the same backend): kernel_backend, kernel_backend_why
    and kernel_fallback (the PyTorch path where a kernel exists for such inputs)."""
    from repro.attention.linear import LinearAttention
    from repro.attention.rfa import RFAAttention

    device = torch.device(device)
    if not isinstance(layer, (LinearAttention, RFAAttention)):
        return _fields("torch", f"{type(layer).__name__}: PyTorch operations (no fused kernel for this attention)",
                       False)
    if not causal:
        return _fields("torch", "non-causal: two matrix products (no causal sums)", False)
    with torch.set_grad_enabled(grad):
        return _fields(*(_linear if isinstance(layer, LinearAttention) else _rfa)(layer, batch, n, dtype, device,
                                                                                  grad))


def product_backend(q, k, v, chunked: bool = False) -> dict:
    """The row fields for repro.kernels.causal_dot_product on q, k, v; chunked: for
    causal_dot_product_chunked, which takes the fused C kernel on a CPU as the dispatcher does but
    never the CUDA kernels."""
    from repro.kernels.plumbing.dtypes import accumulation_dtype

    if chunked and q.is_cuda:
        return _fields("torch", "the chunked PyTorch path (the CUDA kernels are the dispatcher's)", False)
    return _fields(*_dispatcher(q, k, v, accumulation_dtype(q.dtype)))


def step_backend(layer, batch: int, dtype, device) -> dict:
    """The row fields for the recurrent step of `layer` (generation, repro.kernels.recurrent.step), one
    token of a batch."""
    from repro.attention.linear import LinearAttention
    from repro.kernels import cupy_unavailable
    from repro.kernels.plumbing.backend import forced_backend
    from repro.kernels.plumbing.dtypes import accumulation_dtype

    device = torch.device(device)
    if not isinstance(layer, LinearAttention):
        return _fields("torch", f"{type(layer).__name__}: PyTorch operations (no fused kernel for its step)", False)
    if device.type != "cuda":
        return _fields("torch", "the step's batched PyTorch products (no fused CPU kernel for the step)", False)
    h, d, m, acc = layer.n_heads, layer.d_keys, layer.d_values, accumulation_dtype(dtype)
    q, v = _stand_in((batch, h, d), dtype, device, False), _stand_in((batch, h, m), dtype, device, False)
    S, Z = torch.zeros(batch, h, d, m, dtype=acc, device=device), torch.zeros(batch, h, d, dtype=acc, device=device)
    if forced_backend() in ("torch", "cpu"):
        return _fields("torch", f"forced by REPRO_KERNEL={forced_backend()}", True)
    why = cupy_unavailable("recurrent", q, q, v, S, Z)
    return _fields("cupy", "the CUDA step kernel", False) if why is None else _fields("torch", why, True)


def model_attention(model):
    """The first attention layer of a model (every layer of the suite's models is the same kind)."""
    from repro.attention.base import AttentionLayer

    return next((m for m in model.modules() if isinstance(m, AttentionLayer)), None)


def model_backend(model, batch: int, n: int, dtype, device, causal: bool = True) -> dict:
    """layer_backend for a model's attention layers (a training step's rows), or {} for a model
    without one (the Bi-LSTM baseline). dtype: what the layer computes in (bf16 under autocast)."""
    layer = model_attention(model)
    return {} if layer is None else layer_backend(layer, batch, n, dtype, device, causal)


def note_fallback(label: str, fields: dict):
    """Print, once per process and label, that the PyTorch path ran where a kernel exists."""
    key = (label, fields.get("kernel_backend_why"))
    if fields.get("kernel_fallback") and key not in _NOTED:
        _NOTED.add(key)
        print(f"note: {label} runs on the PyTorch path (slower): {fields['kernel_backend_why']}", file=sys.stderr,
              flush=True)
