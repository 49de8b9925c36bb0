"""bidirectional=true for the causal-only successors (gla, delta; repro/attention/successors.py):
the non-causal layer against a float64 reference written here from the equations (a loop left
to right over each sequence's valid frames plus a loop over them reversed, summed, then the
norm, gate and output projection), with a key-padding mask of different lengths, odd lengths and
chunks, forward and backward; padded frames change nothing; the reversal index; the refusal
without the option, in the layer and in the speech task's config check."""
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from repro.attention.gla import GatedLinearAttention
from repro.attention.successors import SuccessorAttention, reversal_index, reverse
from repro.common.errors import ConfigError
from repro.conf import compose_group

D_MODEL, H, D, M = 24, 3, 6, 10


def build(name, **kw):
    cfg = OmegaConf.merge(compose_group("attention", name), {"bidirectional": True, "output_gate": True}, kw)
    return instantiate(cfg)(d_model=D_MODEL, n_heads=H, d_keys=D, d_values=M).double()


def padding(n, lengths):
    return torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]  # (B, N) True at padding


def scan(layer, q, k, v, w):
    """One direction, one sequence: q, k (N, H, D), v (N, H, M), w the per-step decay (N, H, D)
    for gla or write strength (N, H) for delta -> o (N, H, M), o_t = S_t^T q_t."""
    S, out = torch.zeros(H, D, M, dtype=torch.float64), []
    for t in range(q.shape[0]):
        if isinstance(layer, GatedLinearAttention):
            S = w[t].exp()[..., None] * S + k[t][..., None] * v[t][:, None, :]  # diag(alpha_t) S + k v^T
        else:
            old = torch.einsum("hd,hdm->hm", k[t], S)  # what key k_t reads now
            S = S + k[t][..., None] * (w[t][:, None] * (v[t] - old))[:, None, :]
        out.append(torch.einsum("hd,hdm->hm", q[t], S))
    return torch.stack(out)


def reference(layer, x):
    """The layer's non-causal output on ONE unpadded sequence x (L, d_model), float64."""
    split = lambda t, d: t.unflatten(-1, (H, d))  # L, H, d
    q, k, v = split(layer.q_proj(x), D), split(layer.k_proj(x), D), split(layer.v_proj(x), M)
    if isinstance(layer, GatedLinearAttention):
        q = q / D ** 0.5
        w = split(F.logsigmoid(layer.alpha_proj(x)) / layer.temperature, D)  # log alpha
    else:
        q, k = (F.silu(t) / F.silu(t).norm(dim=-1, keepdim=True) for t in (q, k))
        w = torch.sigmoid(layer.beta_proj(x))  # beta (L, H)
    o = scan(layer, q, k, v, w) + scan(layer, q.flip(0), k.flip(0), v.flip(0), w.flip(0)).flip(0)
    if layer.norm.kind == "layer":
        o = o - o.mean(-1, keepdim=True)
    o = o / torch.sqrt(o.square().mean(-1, keepdim=True) + 1e-5) * layer.norm.weight
    if layer.norm.bias is not None:
        o = o + layer.norm.bias
    o = o * F.silu(split(layer.gate_proj(x), M))
    return layer.out_proj(o.flatten(-2))


@pytest.mark.parametrize("chunk", [5, None])
@pytest.mark.parametrize("name", ["gla", "delta"])
def test_both_directions_equal_the_two_loops_forward_and_backward(name, chunk):
    torch.manual_seed(3)
    layer = build(name, chunk_size=chunk)
    lengths, n = [37, 26, 9], 37
    mask = padding(n, lengths)
    x = torch.randn(3, n, D_MODEL, dtype=torch.float64, requires_grad=True)
    y = layer(x, causal=False, key_padding_mask=mask)
    refs = [reference(layer, x[b, :length]) for b, length in enumerate(lengths)]
    for b, length in enumerate(lengths):
        torch.testing.assert_close(y[b, :length], refs[b], rtol=1e-9, atol=1e-11)
    wts = torch.randn_like(y)
    params = [x, *layer.parameters()]
    got = torch.autograd.grad((y * wts * ~mask[..., None]).sum(), params)
    want = torch.autograd.grad(sum((r * wts[b, :len(r)]).sum() for b, r in enumerate(refs)), params)
    for (pname, _), g, r in zip([("x", x), *layer.named_parameters()], got, want):
        assert r.abs().max() > 0, pname  # a check that can fail: every gradient is there to compare
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10, msg=lambda m: f"{pname}: {m}")  # noqa: B023


@pytest.mark.parametrize("name", ["gla", "delta"])
def test_without_a_mask_and_both_passes_count(name):
    layer = build(name, chunk_size=8)
    x = torch.randn(2, 29, D_MODEL, dtype=torch.float64)
    y = layer(x, causal=False)
    for b in range(2):
        torch.testing.assert_close(y[b], reference(layer, x[b]), rtol=1e-9, atol=1e-11)
    # the non-causal form sees the future (else a lost pass would pass the test above only by luck)
    x2 = x.clone()
    x2[:, -1] += 1
    assert (layer(x2, causal=False)[:, 0] - y[:, 0]).abs().max() > 1e-6
    # the causal form is the causal one still, and so is its recurrent twin
    causal = build(name, chunk_size=8, bidirectional=False)
    causal.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(x, causal=True), causal(x, causal=True), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gla", "delta"])
def test_padded_frames_change_nothing(name):
    layer = build(name, chunk_size=8)
    lengths, n = [31, 20, 9], 31
    mask = padding(n, lengths)
    x = torch.randn(3, n, D_MODEL, dtype=torch.float64)
    x2 = torch.where(mask[..., None], 10 * torch.randn_like(x), x)
    outs, grads = [], []
    for inp in (x, x2):
        inp = inp.clone().requires_grad_(True)
        y = layer(inp, causal=False, key_padding_mask=mask)
        (y * ~mask[..., None]).pow(2).sum().backward()
        outs.append(y[~mask])
        grads.append(inp.grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)
    assert grads[0][mask].abs().max() == 0


def test_the_reversal_index_mirrors_valid_positions_and_keeps_padding_in_place():
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
    index = reversal_index(keep[:, None, :], 5, keep.device)
    assert index.tolist() == [[4, 3, 2, 1, 0], [2, 1, 0, 3, 4], [0, 1, 2, 3, 4], [3, 1, 2, 0, 4]]
    t = torch.randn(4, 2, 5, 3)  # (B, H, N, D)
    torch.testing.assert_close(reverse(reverse(t, index, 2), index, 2), t, rtol=0, atol=0)
    assert torch.equal(reverse(t, index, 2)[1, :, :3], t[1, :, :3].flip(1))
    assert torch.equal(reverse(t, None, 2), t.flip(2))


@pytest.mark.parametrize("name", ["gla", "delta"])
def test_without_the_option_causal_false_is_refused_saying_how_to_enable_it(name):
    layer = build(name, bidirectional=False)
    with pytest.raises(ConfigError, match=f"attention {name} .* is causal only.*attention.bidirectional=true") as err:
        layer(torch.randn(1, 5, D_MODEL, dtype=torch.float64), causal=False)
    assert "\n" not in str(err.value)


def test_the_option_is_refused_where_there_is_a_non_causal_form():
    with pytest.raises(ValueError, match="successor: bidirectional=true is for the causal-only attentions"):
        SuccessorAttention(16, 2, bidirectional=True)


@pytest.mark.parametrize("encoder", ["softmax", "linear", "retention", "gla", "delta"])
def test_the_speech_task_accepts_every_successor_encoder(compose_cfg, encoder):
    from repro.cli.validate import validate

    validate(compose_cfg("experiment=asr_table_cpu", f"encoder={encoder}"))


@pytest.mark.parametrize("name", ["gla", "delta"])
def test_the_speech_task_refuses_a_causal_only_attention_without_the_option(compose_cfg, name):
    from repro.cli.validate import validate

    with pytest.raises(ConfigError, match=f"attention {name} is causal only and task=asr is non-causal; .*"
                                          r"retention, or attention.bidirectional=true") as err:
        validate(compose_cfg("experiment=asr_table_cpu", f"encoder={name}", "attention.bidirectional=false"))
    assert "\n" not in str(err.value)
