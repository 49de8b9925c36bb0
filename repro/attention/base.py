"""The multi-head attention layer every attention type shares: projections around an inner
attention on (B, H, N, D) tensors, plus the recurrent step for types that have one."""
import torch
from torch import nn


class AttentionLayer(nn.Module):
    """y = layer(x, causal=..., key_padding_mask=...) with x, y of shape (B, N, d_model).

    key_padding_mask: bool (B, N), True where the position is padding (as in
    torch.nn.MultiheadAttention); padded keys take no part in any output.

    Types with a recurrent form set `recurrent = True` and implement `attend_step`; then
    `y_t, state = layer.step(x_t, state)` with x_t, y_t of shape (B, d_model) and state=None
    before the first token. A step may update the state's buffers in place: treat the state
    passed in as consumed.
    """

    recurrent = False
    # True where the algorithm has no non-causal form (its update runs along the sequence): the
    # layer refuses causal=False, and so does a run's config check (repro.cli.validate)
    causal_only = False
    # Generation puts a faster projection for the step here (repro.models.generate.StepProjections);
    # None: the plain modules.
    step_projections = None

    def __init__(self, d_model: int, n_heads: int, d_keys: int | None = None, d_values: int | None = None):
        super().__init__()
        if n_heads < 1 or d_model < 1:
            raise ValueError(f"attention: d_model and n_heads must be positive; got d_model={d_model}, "
                             f"n_heads={n_heads}")
        if (d_keys is None or d_values is None) and d_model % n_heads:
            raise ValueError(f"attention: d_model={d_model} is not divisible by n_heads={n_heads}; "
                             f"choose another n_heads or set d_keys and d_values")
        self.d_model, self.n_heads = d_model, n_heads
        self.d_keys = d_keys or d_model // n_heads
        self.d_values = d_values or d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.d_keys)
        self.k_proj = nn.Linear(d_model, n_heads * self.d_keys)
        self.v_proj = nn.Linear(d_model, n_heads * self.d_values)
        self.out_proj = nn.Linear(n_heads * self.d_values, d_model)

    def attend(self, q, k, v, causal: bool, key_padding_mask):
        """(B, H, N, D), (B, H, N, D), (B, H, N, M) -> (B, H, N, M)."""
        raise NotImplementedError

    def attend_step(self, q, k, v, state):
        """(B, H, D), (B, H, D), (B, H, M), state -> (B, H, M), state."""
        raise NotImplementedError

    def _heads(self, x, proj, d):
        return proj(x).unflatten(-1, (self.n_heads, d)).transpose(-2, -3)  # (B, H, N, d)

    def forward(self, x, causal: bool = False, key_padding_mask=None):
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{type(self).__name__}: x must be (B, N, d_model={self.d_model}); got {tuple(x.shape)}")
        if key_padding_mask is not None and (key_padding_mask.shape != x.shape[:2]
                                             or key_padding_mask.dtype != torch.bool):
            raise ValueError(f"{type(self).__name__}: key_padding_mask must be bool (B, N) = {tuple(x.shape[:2])}; "
                             f"got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
        q = self._heads(x, self.q_proj, self.d_keys)
        k = self._heads(x, self.k_proj, self.d_keys)
        v = self._heads(x, self.v_proj, self.d_values)
        y = self.attend(q, k, v, causal=causal, key_padding_mask=key_padding_mask)  # (B, H, N, M)
        return self.out_proj(y.transpose(1, 2).flatten(-2))

    def step(self, x, state=None):
        if not self.recurrent:
            raise NotImplementedError(f"{type(self).__name__} has no recurrent form; "
                                      f"generate with it by re-running the prefix")
        if x.dim() != 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"{type(self).__name__}.step: x must be (B, d_model={self.d_model}); got {tuple(x.shape)}")
        fast = self.step_projections
        if fast is not None and fast.usable():
            q, k, v = fast.qkv(x)  # (B, H D) each, (B, H M)
        else:
            fast = None
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        y, state = self.attend_step(q.unflatten(-1, (self.n_heads, self.d_keys)),
                                    k.unflatten(-1, (self.n_heads, self.d_keys)),
                                    v.unflatten(-1, (self.n_heads, self.d_values)), state)  # (B, H, M)
        y = y.flatten(-2)  # (B, H M)
        return (self.out_proj(y) if fast is None else fast.out(y)), state


def is_recurrent(layer) -> bool:
    """Has this attention a recurrent form (`y_t, state = layer.step(x_t, state)`)? An
    AttentionLayer says so (`recurrent`); any other nn.Module, by having a `step`."""
    return bool(getattr(layer, "recurrent", callable(getattr(layer, "step", None))))
