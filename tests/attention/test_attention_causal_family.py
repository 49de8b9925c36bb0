"""Reformer LSH, Performer FAVOR+, RFA and local attention: causality, recurrent == parallel
(layer and model), agreement with naive float64 references, FAVOR+ convergence, odd N, D != M,
padding, bf16, and the one-line errors."""
import math

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from repro.attention.local import LocalAttention
from repro.attention.lsh import LSHAttention
from repro.attention.performer import PerformerAttention
from repro.attention.rfa import RFAAttention
from repro.conf import compose_group
from repro.kernels import gated_causal_dot_product
from repro.models import AutoregressiveTransformer

CONFIGS = ["lsh-1", "lsh-4", "lsh-8", "performer", "rfa", "local", "retention", "gla", "delta"]
# Small settings so the short test sequences span several chunks, buckets and windows.
SMALL = {"lsh-1": {"n_buckets": 4, "chunk_size": 8}, "lsh-4": {"n_buckets": 4, "chunk_size": 8},
         "lsh-8": {"n_buckets": 4, "chunk_size": 8}, "performer": {"n_features": 32},
         "rfa": {"n_features": 16, "chunk_size": 8}, "local": {"window": 6},
         "retention": {"chunk_size": 8}, "gla": {"chunk_size": 8}, "delta": {"chunk_size": 8}}
RECURRENT = {"performer": {}, "rfa": {}, "rfa-ungated": {"gate": False}, "local": {}, "retention": {}, "gla": {},
             "delta": {}}


def build(name, d_model=24, n_heads=3, dtype=torch.float64, **kw):
    """A layer from conf/attention/<name>.yaml with SMALL settings (and kw) applied, in eval."""
    base, extra = name.split("-ungated")[0], {"gate": False} if name.endswith("-ungated") else {}
    cfg = compose_group("attention", base)
    OmegaConf.set_struct(cfg, False)
    cfg = OmegaConf.merge(cfg, SMALL[base], extra, kw)
    return instantiate(cfg)(d_model=d_model, n_heads=n_heads).to(dtype).eval()


# ------------------------------------------------------------------ configs and errors

@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_builds_the_paper_settings(name):
    layer = instantiate(compose_group("attention", name))(d_model=256, n_heads=8)
    if name.startswith("lsh"):
        assert (layer.n_buckets, layer.chunk_size, layer.n_hashes) == (64, 32, int(name[-1]))
        assert layer.k_proj is None  # shared query/key projection
    y = layer(torch.randn(1, 50, 256), causal=True)
    assert y.shape == (1, 50, 256) and torch.isfinite(y).all()


def test_bad_settings_get_one_line_errors():
    with pytest.raises(ValueError, match="n_buckets must be 1 or a positive even"):
        LSHAttention(16, 2, n_buckets=3)
    with pytest.raises(ValueError, match="unknown combine 'max'; valid: lse, mean"):
        LSHAttention(16, 2, combine="max")
    with pytest.raises(NotImplementedError, match="no recurrent form"):
        LSHAttention(16, 2).step(torch.randn(1, 16))
    with pytest.raises(ValueError, match="window must be >= 1"):
        LocalAttention(16, 2, window=0)
    with pytest.raises(ValueError, match="n_features must be >= 1"):
        PerformerAttention(16, 2, n_features=0)
    with pytest.raises(ValueError, match="use causal=True or gate=false"):
        RFAAttention(16, 2)(torch.randn(1, 5, 16), causal=False)


# ------------------------------------------------------------------ causality

@pytest.mark.parametrize("name", ["performer", "rfa", "rfa-ungated", "local", "lsh-one-bucket", "retention", "gla",
                                  "delta"])
def test_perturbing_token_j_changes_nothing_before_j(name):
    layer = (LSHAttention(24, 3, n_buckets=1, chunk_size=8, n_hashes=2).double().eval()
             if name == "lsh-one-bucket" else build(name))
    x = torch.randn(2, 37, 24, dtype=torch.float64)
    j = 20
    x2 = x.clone()
    x2[:, j] += torch.randn(2, 24, dtype=torch.float64)
    y, y2 = layer(x, causal=True), layer(x2, causal=True)
    torch.testing.assert_close(y2[:, :j], y[:, :j], rtol=0, atol=1e-12)
    assert (y2[:, j] - y[:, j]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["lsh-1", "lsh-4", "lsh-8"])
def test_lsh_never_reads_a_later_token(name):
    """Hashed LSH: which earlier keys share a chunk depends on all bucket counts (Reformer's
    chunking), so perturb token j only where its query, hence every hash, stays put (the null
    space of W_q): its value then must reach no earlier output, and must reach later ones."""
    layer = build(name, d_model=32, n_heads=2, d_keys=8)  # W_q: (16, 32), null space of dim 16
    null = torch.linalg.svd(layer.q_proj.weight.detach())[2][16:]  # (16, 32)
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    j = 17
    x2 = x.clone()
    x2[:, j] += 3 * torch.randn(2, 16, dtype=torch.float64) @ null
    y, y2 = layer(x, causal=True), layer(x2, causal=True)
    torch.testing.assert_close(y2[:, :j], y[:, :j], rtol=0, atol=1e-12)
    assert (y2[:, j + 1:] - y[:, j + 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["lsh-4", "performer", "rfa", "rfa-ungated", "local", "retention", "gla", "delta"])
def test_padded_keys_take_no_part(name):
    layer = build(name)
    x = torch.randn(2, 29, 24, dtype=torch.float64)
    pad = torch.zeros(2, 29, dtype=torch.bool)
    pad[0, 5:9] = pad[1, 20:] = True
    x2 = x.masked_fill(pad[..., None], 0.0) + 5 * pad[..., None] * torch.randn_like(x)
    for causal in ([True] if name == "rfa" or layer.causal_only else [True, False]):
        y, y2 = layer(x, causal=causal, key_padding_mask=pad), layer(x2, causal=causal, key_padding_mask=pad)
        torch.testing.assert_close(y2[~pad], y[~pad], rtol=0, atol=1e-10)


# ------------------------------------------------------------------ recurrent == parallel

@pytest.mark.parametrize("name", list(RECURRENT))
@pytest.mark.parametrize("n", [1, 23])
def test_layer_step_equals_forward(name, n):
    layer = build(name, d_model=24, n_heads=3, d_keys=6, d_values=10)  # D != M, odd N
    x = torch.randn(2, n, 24, dtype=torch.float64)
    y = layer(x, causal=True)
    state, steps = None, []
    for t in range(n):
        y_t, state = layer.step(x[:, t], state)
        steps.append(y_t)
    torch.testing.assert_close(torch.stack(steps, 1), y, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["performer", "rfa", "local", "retention", "gla", "delta"])
def test_model_step_equals_forward(name):
    cfg = OmegaConf.merge(compose_group("attention", name), SMALL[name])
    model = AutoregressiveTransformer(instantiate(cfg), n_tokens=11, n_layers=2, d_model=32, n_heads=4,
                                      d_ff=48, dropout=0.0).double().eval()
    tokens = torch.randint(0, 11, (2, 19))
    out = model(tokens)
    state, steps = None, []
    for t in range(tokens.shape[1]):
        o, state = model.step(tokens[:, t], state)
        steps.append(o)
    torch.testing.assert_close(torch.stack(steps, 1), out, rtol=1e-8, atol=1e-9)


# ------------------------------------------------------------------ against naive references

def _self_rule_softmax(q, k, v, causal):
    """Naive float64: softmax(q k^T / sqrt(D)) over j <= i (all j if not causal), j != i, except
    the token attends to itself when nothing else is left."""
    n = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.ones(n, n, dtype=torch.bool).tril() if causal else torch.ones(n, n, dtype=torch.bool)
    others = allowed & ~torch.eye(n, dtype=torch.bool)
    mask = torch.where(others.any(-1, keepdim=True), others, torch.eye(n, dtype=torch.bool))
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("n_hashes,combine", [(1, "lse"), (3, "lse"), (2, "mean")])
@pytest.mark.parametrize("causal", [True, False])
def test_lsh_one_bucket_one_chunk_is_softmax_with_the_self_rule(n_hashes, combine, causal):
    layer = LSHAttention(24, 3, d_keys=6, d_values=10, n_buckets=1, chunk_size=40, n_hashes=n_hashes,
                         combine=combine).double().eval()  # one chunk covers N = 37 (padded to 40)
    x = torch.randn(2, 37, 24, dtype=torch.float64, requires_grad=True)
    y = layer(x, causal=causal)
    q = layer._heads(x, layer.q_proj, 6)
    v = layer._heads(x, layer.v_proj, 10)
    ref = layer.out_proj(_self_rule_softmax(q, F.normalize(q, dim=-1), v, causal).transpose(1, 2).flatten(-2))
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(y)
    gx, = torch.autograd.grad(y, x, g)
    gref, = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(gx, gref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("causal", [True, False])
def test_local_equals_windowed_softmax(causal):
    w = 5
    layer = LocalAttention(24, 3, d_keys=6, d_values=10, window=w).double()
    q, k = torch.randn(2, 2, 3, 23, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 23, 10, dtype=torch.float64, requires_grad=True)
    i, j = torch.arange(23)[:, None], torch.arange(23)[None, :]
    near = ((i - j >= 0) & (i - j < w)) if causal else (i - j).abs() < w
    ref = (q @ k.transpose(-1, -2) / math.sqrt(6)).masked_fill(~near, float("-inf")).softmax(-1) @ v
    out = layer.attend(q, k, v, causal=causal, key_padding_mask=None)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_gated_parallel_form_equals_decay_matrix():
    """The chunked gated form against the explicit (N, N) decay matrix, forward and backward."""
    q, k = torch.randn(2, 2, 3, 13, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 13, 7, dtype=torch.float64, requires_grad=True)
    log_g = F.logsigmoid(torch.randn(2, 3, 13, dtype=torch.float64)).requires_grad_()
    out = gated_causal_dot_product(q, k, v, log_g, chunk_size=4)
    c = log_g.cumsum(-1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~torch.ones(13, 13, dtype=torch.bool).tril(),
                                                            float("-inf")).exp()
    ref = ((q @ k.transpose(-1, -2)) * decay) @ v
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v, log_g), g), torch.autograd.grad(ref, (q, k, v, log_g), g)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_performer_equals_quadratic_form_of_its_features():
    layer = PerformerAttention(24, 3, d_keys=6, d_values=10, n_features=20).double().eval()
    q, k = torch.randn(2, 2, 3, 17, 6, dtype=torch.float64)
    v = torch.randn(2, 3, 17, 10, dtype=torch.float64)
    pq, pk = layer.feature_map(q), layer.feature_map(k)
    # the features themselves, from their formula: exp(w.x' - |x'|^2 / 2) / sqrt(F), x' = x / D^(1/4)
    xs = q / 6 ** 0.25
    torch.testing.assert_close(
        pq, torch.exp(xs @ layer.feature_map.omega.T - (xs ** 2).sum(-1, keepdim=True) / 2) / math.sqrt(20))
    a = (pq @ pk.transpose(-1, -2)).tril()
    ref = (a @ v) / (a.sum(-1, keepdim=True) + layer.eps)
    torch.testing.assert_close(layer.attend(q, k, v, causal=True, key_padding_mask=None), ref, rtol=1e-10, atol=1e-12)


def test_favor_error_to_softmax_falls_with_more_features():
    q, k = 0.5 * torch.randn(2, 1, 2, 64, 16, dtype=torch.float64)
    v = torch.randn(1, 2, 64, 8, dtype=torch.float64)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    errors = []
    for n_features in (8, 128, 2048):
        layer = PerformerAttention(32, 2, d_keys=16, n_features=n_features).double()
        err = []
        for _ in range(4):  # average over draws
            layer.feature_map.new_feature_map()
            err.append((layer.attend(q, k, v, causal=True, key_padding_mask=None) - exact).norm() / exact.norm())
        errors.append(torch.stack(err).mean().item())
    assert errors[0] > errors[1] > errors[2] and errors[2] < errors[0] / 4, errors


# ------------------------------------------------------------------ modes and dtypes

def test_eval_is_deterministic_and_training_redraws():
    x = torch.randn(1, 40, 24, dtype=torch.float64)
    for layer in (build("lsh-4"), build("performer", redraw_every=1), build("rfa")):
        torch.testing.assert_close(layer(x, causal=True), layer(x, causal=True), rtol=0, atol=0)
        layer.train()
        _, y2 = layer(x, causal=True), layer(x, causal=True)
        y3 = layer(x, causal=True)
        assert not torch.equal(y2, y3), type(layer).__name__


@pytest.mark.parametrize("name", CONFIGS)
def test_bfloat16_forward_backward_close_to_float32(name):
    kw = {"n_buckets": 1} if name.startswith("lsh") else {}  # bf16 rounding may move a hash otherwise
    layer32 = build(name, dtype=torch.float32, **kw)
    layer16 = build(name, dtype=torch.float32, **kw)
    layer16.load_state_dict(layer32.state_dict())
    layer16 = layer16.to(torch.bfloat16)
    x = torch.randn(2, 31, 24)
    x16 = x.to(torch.bfloat16).requires_grad_()
    y32, y16 = layer32(x, causal=True), layer16(x16, causal=True)
    assert y16.dtype == torch.bfloat16
    y16.float().square().sum().backward()
    assert torch.isfinite(x16.grad).all()
    assert (y16.float() - y32).norm() / y32.norm() < 0.05
