"""The successors' layers (conf/attention retention, gla, delta) against their formulas written
here in float64 from the papers (on the kernels' per-step recurrences, or an explicit decay
matrix), their paper settings, gradients to every parameter, padding, the refusal of a
non-causal call where there is no non-causal form, and the one-line errors. Causality,
recurrent == parallel (layer and model) and bf16 run with the causal family
(tests/attention/test_attention_causal_family.py); padding invariance over every config in
tests/attention/test_attention_noncausal_family.py."""
import math

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from repro.attention.delta import DeltaRuleAttention
from repro.attention.gla import GatedLinearAttention
from repro.attention.retention import Retention
from repro.common.errors import ConfigError
from repro.conf import compose_group
from repro.kernels.delta.reference import delta_rule_loop
from repro.kernels.gated.reference import gated_causal_dot_product_loop

NAMES = ["retention", "gla", "delta"]


def build(name, d_model=24, n_heads=3, **kw):
    cfg = compose_group("attention", name)
    OmegaConf.set_struct(cfg, False)
    cfg = OmegaConf.merge(cfg, {"chunk_size": 8}, kw)
    return instantiate(cfg)(d_model=d_model, n_heads=n_heads, d_keys=6, d_values=10).double().eval()


def heads(layer, x, proj, d):
    return proj(x).unflatten(-1, (layer.n_heads, d)).transpose(1, 2)  # (B, H, N, d)


def finish(layer, x, o, gate=True):
    """norm, swish gate, output projection, written out: o (B, H, N, M) -> (B, N, d_model)."""
    o = o - o.mean(-1, keepdim=True) if layer.norm.kind == "layer" else o
    o = o / torch.sqrt(o.square().mean(-1, keepdim=True) + 1e-5) * layer.norm.weight[:, None, :]
    if layer.norm.bias is not None:
        o = o + layer.norm.bias[:, None, :]
    if gate and layer.gate_proj is not None:
        o = o * F.silu(heads(layer, x, layer.gate_proj, layer.d_values))
    return layer.out_proj(o.transpose(1, 2).flatten(-2))


def formula(layer, x, causal=True):
    """The layer's output from its paper's equations, float64."""
    q, k, v = (heads(layer, x, p, d) for p, d in ((layer.q_proj, 6), (layer.k_proj, 6), (layer.v_proj, 10)))
    n = x.shape[1]
    if isinstance(layer, Retention):
        gamma = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(layer.n_heads)], dtype=torch.float64)
        i = torch.arange(n)
        dist = (i[:, None] - i[None, :]).double()
        decay = gamma[:, None, None] ** (dist.clamp(min=0) if causal else dist.abs())  # (H, N, N)
        if causal:
            decay = decay * (dist >= 0)
        o = ((q @ k.mT / math.sqrt(6)) * decay) @ v
    elif isinstance(layer, GatedLinearAttention):
        w1, w2 = layer.alpha_proj
        log_alpha = F.logsigmoid(x @ w1.weight.T @ w2.weight.T + w2.bias) / 16  # sigmoid(.)^(1/16)
        o = gated_causal_dot_product_loop(q / math.sqrt(6), k, v, log_alpha.unflatten(-1, (3, 6)).transpose(1, 2))
    else:
        beta = torch.sigmoid(x @ layer.beta_proj.weight.T + layer.beta_proj.bias).transpose(1, 2)  # (B, H, N)
        unit = lambda t: F.silu(t) / F.silu(t).norm(dim=-1, keepdim=True)
        o = delta_rule_loop(unit(q), unit(k), v, beta)
    return finish(layer, x, o)


@pytest.mark.parametrize("name", NAMES)
def test_layer_equals_its_formula(name):
    layer = build(name)
    x = torch.randn(2, 29, 24, dtype=torch.float64, requires_grad=True)
    y, ref = layer(x, causal=True), formula(layer, x)
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-11)
    g = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0], rtol=1e-8,
                               atol=1e-10)


def test_non_causal_retention_decays_by_distance():
    layer = build("retention")
    x = torch.randn(2, 29, 24, dtype=torch.float64)
    torch.testing.assert_close(layer(x, causal=False), formula(layer, x, causal=False), rtol=1e-9, atol=1e-11)


def test_paper_settings():
    ret = instantiate(compose_group("attention", "retention"))(d_model=256, n_heads=8)
    torch.testing.assert_close(ret.log_gamma.exp(), 1 - 2.0 ** (-5 - torch.arange(8, dtype=torch.float64)))
    gla = instantiate(compose_group("attention", "gla"))(d_model=256, n_heads=8)
    assert [tuple(m.weight.shape) for m in gla.alpha_proj] == [(16, 256), (256, 16)] and gla.temperature == 16
    assert gla.alpha_proj[0].bias is None and gla.norm.kind == "layer" and gla.gate_proj is not None
    delta = instantiate(compose_group("attention", "delta"))(d_model=256, n_heads=8)
    assert delta.feature_map == "silu" and tuple(delta.beta_proj.weight.shape) == (8, 256)
    assert delta.norm.kind == "rms" and delta.gate_proj is None
    for layer in (ret, gla, delta):
        y = layer(torch.randn(2, 70, 256), causal=True)
        assert y.shape == (2, 70, 256) and torch.isfinite(y).all()


@pytest.mark.parametrize("name,causal", [("retention", True), ("retention", False), ("gla", True), ("delta", True)])
def test_gradients_reach_every_parameter(name, causal):
    layer = build(name, output_gate=True).train()
    x = torch.randn(2, 19, 24, dtype=torch.float64)
    layer(x, causal=causal).square().sum().backward()
    for pname, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, pname


@pytest.mark.parametrize("name,causal", [("retention", True), ("retention", False), ("gla", True), ("delta", True)])
def test_padded_batch_equals_unpadded_sequences(name, causal):
    layer = build(name)
    lengths, n = [31, 20, 9], 31
    x = torch.randn(3, n, 24, dtype=torch.float64)
    mask = torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]
    y = layer(x, causal=causal, key_padding_mask=mask)
    for i, length in enumerate(lengths):
        torch.testing.assert_close(y[i:i + 1, :length], layer(x[i:i + 1, :length], causal=causal), rtol=1e-9,
                                   atol=1e-11)


@pytest.mark.parametrize("name", ["gla", "delta"])
def test_non_causal_is_refused_in_one_line(name):
    layer = build(name)
    with pytest.raises(ConfigError, match=f"attention {name} .* is causal only.*softmax, linear, retention") as err:
        layer(torch.randn(1, 5, 24, dtype=torch.float64), causal=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("make, message", [
    (lambda: Retention(16, 2, gammas=[0.9, 1.5]),
     r"gammas must be 2 decays in \(0, 1\], one per head; got \[0.9, 1.5\]"),
    (lambda: Retention(16, 2, norm="batch"), "norm must be one of layer, rms, none; got 'batch'"),
    (lambda: GatedLinearAttention(16, 2, gate_rank=0), "gate_rank must be >= 1 and gate_temperature > 0"),
    (lambda: GatedLinearAttention(16, 2, gate_temperature=0), "got gate_rank=16, gate_temperature=0"),
    (lambda: DeltaRuleAttention(16, 2, feature_map="dpfp"), "feature_map must be one of silu, elu1, relu, identity"),
    (lambda: DeltaRuleAttention(16, 2, chunk_size=0), "delta: chunk_size must be >= 1 or null"),
])
def test_bad_settings_get_one_line_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_attend_alone_says_to_call_the_layer():
    layer = build("gla")
    q = torch.randn(1, 3, 5, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"gla: call the layer itself"):
        layer.attend(q, q, torch.randn(1, 3, 5, 10, dtype=torch.float64), True, None)
