"""Generation keeps constant memory where the paper says it does: the recurrent state of every
attention with an RNN form (linear, Performer, RFA, the local window, and whatever conf/attention
adds) holds as many bytes after 300 tokens as after 10, while stateful softmax's key/value cache
holds every token seen (between t and 2t positions: it doubles when full)."""
import dataclasses

import pytest
import torch
from hydra.utils import get_class, instantiate

from repro.conf import compose_group
from repro.conf.attention import named_attentions

# every attention config whose class has a recurrent form (the others re-run the prefix to generate)
CONFIGS = sorted(name for name in named_attentions() if get_class(compose_group("attention", name)._target_).recurrent)
D_MODEL, HEADS = 32, 4


def state_bytes(state) -> int:
    """Bytes of the distinct storages of every tensor the state holds."""
    tensors = [v for v in (dataclasses.asdict(state).values() if dataclasses.is_dataclass(state) else state)
               if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def grow(layer, steps):
    """{t: state bytes after t tokens} for t in steps, stepping the layer one token at a time."""
    state, out, x = None, {}, torch.randn(2, max(steps), D_MODEL)
    with torch.no_grad():
        for t in range(max(steps)):
            _, state = layer.step(x[:, t], state)
            if t + 1 in steps:
                out[t + 1] = state_bytes(state)
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_the_recurrent_state_does_not_grow_with_the_tokens(name):
    layer = instantiate(compose_group("attention", name))(d_model=D_MODEL, n_heads=HEADS).eval()
    sizes = grow(layer, (10, 100, 300))
    if name.startswith("softmax"):  # the key/value cache: every token's key and value, (B, H, t, D) each
        per_token = 2 * 2 * D_MODEL * 4  # batch 2, keys and values, fp32
        assert all(t * per_token <= b <= 2 * max(t, layer.initial_cache) * per_token for t, b in sizes.items())
        assert sizes[300] > sizes[10]
    else:
        assert len(set(sizes.values())) == 1 and sizes[10] > 0, sizes
