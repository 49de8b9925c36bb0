"""Sampling a sequence from an autoregressive model, the three ways the paper compares:

  recurrent  one model.step per token: linear attention's RNN form, softmax's key/value cache
             (the paper's "stateful softmax"); constant (linear) or growing (cache) cost per token
  rerun      the whole prefix through the parallel forward for every new token: the paper's
             softmax baseline, and the only way for attentions without a recurrent form (LSH)
"""
import torch

MODES = ("recurrent", "rerun")


@torch.no_grad()
def generate(model, prefix, length: int, sample_fn, mode: str = "recurrent", on_step=None):
    """prefix (B, k >= 1) tokens -> (B, length): the prefix, then sampled tokens.

    sample_fn maps the model's outputs at one position (B, d_out) to tokens (B,). on_step(t) is
    called after each sampled position t (for progress bars and timing)."""
    if mode not in MODES:
        raise ValueError(f"generate: unknown mode {mode!r}; valid: {', '.join(MODES)}")
    b, k = prefix.shape
    if not 1 <= k <= length:
        raise ValueError(f"generate: the prefix must hold 1..length={length} tokens; got {k}")
    seq = prefix.new_empty(b, length)
    seq[:, :k] = prefix
    if mode == "recurrent":
        state = None
        for t in range(length - 1):  # feeding token t yields the distribution of token t + 1
            y, state = model.step(seq[:, t], state)
            if t + 1 >= k:
                seq[:, t + 1] = sample_fn(y)
                if on_step:
                    on_step(t + 1)
    else:
        for t in range(k, length):
            seq[:, t] = sample_fn(model(seq[:, :t])[:, -1])
            if on_step:
                on_step(t)
    return seq
