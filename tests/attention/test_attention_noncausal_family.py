"""The non-causal attention family (linformer, nystrom, bigbird, longshort) against naive
float64 references written here from the papers' formulas, their exact limits (softmax), and
key-padding invariance for EVERY config in conf/attention (globbed at test time, so attentions
added later are covered without editing this file)."""
import math

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from repro.attention.nystrom import iterative_pinv
from repro.common.errors import ConfigError
from repro.conf import compose_group
from repro.conf.attention import named_attentions

ALL_CONFIGS = named_attentions()  # custom (the user's class) aside: tests/attention/test_conformance.py
FAMILY = ["linformer", "nystrom", "bigbird", "longshort"]


def build(name, d_model=32, n_heads=4, **settings):
    cfg = compose_group("attention", name)
    for key, value in settings.items():
        cfg[key] = value
    return instantiate(cfg)(d_model=d_model, n_heads=n_heads).eval()


def qkv(b=2, h=3, n=29, d=8, m=None, dtype=torch.float64):
    g = [torch.randn(b, h, n, dd, dtype=dtype, requires_grad=True) for dd in (d, d, m or d)]
    return g


def padding(b, n, lengths):
    """bool (B, N), True after each sequence's length (the speech batches' layout)."""
    return torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]


def ref_attention(q, k, v, allowed):
    """Naive float64 softmax(q k^T / sqrt(D)) v over the allowed (query, key) pairs; rows with
    no allowed key give 0."""
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    return p @ v


def assert_close_fwd_bwd(out, ref, inputs, real_rows=None, atol=1e-9, rtol=1e-7):
    """Outputs and the gradients of a random projection of them agree (on the real rows)."""
    w = torch.randn_like(ref)
    if real_rows is not None:
        w = w * real_rows[:, None, :, None]
        out, ref = out * real_rows[:, None, :, None], ref * real_rows[:, None, :, None]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    g_out = torch.autograd.grad((out * w).sum(), inputs, retain_graph=True)
    g_ref = torch.autograd.grad((ref * w).sum(), inputs)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, atol=atol * 10, rtol=rtol * 10)


# ------------------------------------------------------------------ every config: padding

@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_padding_changes_no_real_output(name):
    """Non-causal, with a key-padding mask: the padded frames' contents change no output or
    gradient of the real frames, and nothing is NaN. An attention that cannot take a mask must
    declare `supports_key_padding_mask = False` and refuse one with an error naming it."""
    torch.manual_seed(1)
    # RFA's gate is a recency decay along a causal scan; its non-causal form is the ungated one.
    settings = {"gate": False} if name == "rfa" else {}
    layer = build(name, d_model=32, n_heads=4, **settings).double()
    b, n = 3, 37
    mask = padding(b, n, [37, 26, 9])
    x = torch.randn(b, n, 32, dtype=torch.float64)
    if getattr(layer, "causal_only", False):  # no non-causal form: refused in one line, naming it
        with pytest.raises(ConfigError, match=f"attention {name} .* is causal only") as err:
            layer(x, causal=False, key_padding_mask=mask)
        assert "\n" not in str(err.value)
        return
    if not getattr(layer, "supports_key_padding_mask", True):
        with pytest.raises((ValueError, NotImplementedError), match="key_padding_mask"):
            layer(x, causal=False, key_padding_mask=mask)
        return
    x2 = torch.where(mask[..., None], 10 * torch.randn_like(x), x)  # other padded contents
    outs, grads = [], []
    for inp in (x, x2):
        inp = inp.clone().requires_grad_(True)
        y = layer(inp, causal=False, key_padding_mask=mask)
        assert y.shape == x.shape and torch.isfinite(y).all(), f"{name}: bad output with padding"
        (y * ~mask[..., None]).pow(2).sum().backward()
        assert torch.isfinite(inp.grad).all()
        outs.append(y[~mask])
        grads.append(inp.grad)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(grads[0][~mask], grads[1][~mask], atol=1e-9, rtol=1e-9)
    # No gradient reaches a padded frame from the real outputs.
    assert grads[0][mask].abs().max() == 0, f"{name}: real outputs depend on padded frames"


# ------------------------------------------------------------------ the family: basics

@pytest.mark.parametrize("name", FAMILY)
def test_causal_is_refused_in_one_line(name):
    layer = build(name)
    with pytest.raises(ConfigError, match=r"non-causal.*softmax, softmax-math, linear") as err:
        layer(torch.randn(1, 5, 32), causal=True)
    assert "\n" not in str(err.value)
    with pytest.raises(NotImplementedError, match="no recurrent form"):
        layer.step(torch.randn(1, 32))


SMALL = {"linformer": {"proj_len": 16, "max_len": 200}, "nystrom": {"landmarks": 8, "conv_kernel": 5},
         "bigbird": {"block": 8, "window": 1, "global_tokens": 3, "random_blocks": 1},
         "longshort": {"window": 8, "rank": 5}}


@pytest.mark.parametrize("n", [1, 7, 61])
@pytest.mark.parametrize("name", FAMILY)
def test_shapes_and_dtypes(name, n):
    """fp32 and bf16, odd N: shape and dtype kept, finite, bf16 close to fp32, and a backward."""
    layer = build(name, **SMALL[name])
    x = torch.randn(2, n, 32)
    y32 = layer(x)
    assert y32.shape == (2, n, 32) and y32.dtype == torch.float32 and torch.isfinite(y32).all()
    layer16 = layer.to(torch.bfloat16)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    y16 = layer16(xb)
    y16.float().sum().backward()
    assert y16.dtype == torch.bfloat16 and torch.isfinite(y16).all() and torch.isfinite(xb.grad).all()
    err = (y16.float() - y32).norm() / y32.norm()
    assert err < 0.05, f"{name}: bf16 relative error {err:.3f}"


@pytest.mark.parametrize("name", FAMILY)
def test_padded_batch_equals_unpadded_sequences(name):
    """Stronger than content invariance: each sequence's real outputs are those of running it
    alone, unpadded (bigbird without random blocks: its pattern depends on the block count)."""
    settings = dict(SMALL[name], **({"random_blocks": 0} if name == "bigbird" else {}))
    layer = build(name, **settings).double()
    lengths, n = [43, 30, 17], 43
    x = torch.randn(3, n, 32, dtype=torch.float64)
    y = layer(x, key_padding_mask=padding(3, n, lengths))
    for i, length in enumerate(lengths):
        alone = layer(x[i:i + 1, :length])
        torch.testing.assert_close(y[i:i + 1, :length], alone, atol=1e-10, rtol=1e-9)


def test_bad_settings_fail_in_one_line():
    with pytest.raises(ValueError, match="exceeds max_len=20"):
        build("linformer", proj_len=4, max_len=20)(torch.randn(1, 21, 32))
    with pytest.raises(ValueError, match="conv_kernel must be an odd"):
        build("nystrom", conv_kernel=4)
    with pytest.raises(ValueError, match="block >= 1"):
        build("bigbird", block=0)
    with pytest.raises(ValueError, match="window >= 2"):
        build("longshort", window=1)


# ------------------------------------------------------------------ Linformer

def test_linformer_identity_projections_are_softmax():
    n = 23
    layer = build("linformer", proj_len=n, max_len=n).double()
    with torch.no_grad():
        layer.E.copy_(torch.eye(n))
        layer.F.copy_(torch.eye(n))
    q, k, v = qkv(n=n)
    out = layer.attend(q, k, v, False, None)
    ref = ref_attention(q, k, v, torch.ones(n, n, dtype=torch.bool))
    assert_close_fwd_bwd(out, ref, (q, k, v))


@pytest.mark.parametrize("share_kv", [False, True])
def test_linformer_matches_reference(share_kv):
    layer = build("linformer", proj_len=6, max_len=40, share_kv=share_kv).double()
    n, lengths = 31, [31, 12]
    q, k, v = qkv(n=n, m=5)
    mask = padding(2, n, lengths)
    E = layer.E[:, :n]
    Fm = E if share_kv else layer.F[:, :n]
    keep = (~mask)[:, None, :, None].double()
    k_proj = torch.einsum("kn,bhnd->bhkd", E, k * keep)  # only the real keys enter E K
    v_proj = torch.einsum("kn,bhnd->bhkd", Fm, v * keep)
    ref = ref_attention(q, k_proj, v_proj, torch.ones(n, 6, dtype=torch.bool))
    out = layer.attend(q, k, v, False, mask)
    assert_close_fwd_bwd(out, ref, (q, k, v), real_rows=~mask)


# ------------------------------------------------------------------ Nystromformer

def test_iterative_pinv_converges_to_pinv():
    A = torch.softmax(3 * torch.randn(4, 9, 9, dtype=torch.float64), -1)
    torch.testing.assert_close(iterative_pinv(A, 30), torch.linalg.pinv(A), atol=1e-8, rtol=1e-6)


def test_nystrom_with_a_landmark_per_token_is_softmax():
    n = 19
    layer = build("nystrom", landmarks=n, pinv_iterations=40, conv_kernel=None).double()
    q, k, v = qkv(n=n, d=8)
    q, k = (t.detach().mul(2).requires_grad_(True) for t in (q, k))  # sharper: a better-conditioned A
    out = layer.attend(q, k, v, False, None)
    ref = ref_attention(q, k, v, torch.ones(n, n, dtype=torch.bool))
    assert_close_fwd_bwd(out, ref, (q, k, v), atol=1e-6, rtol=1e-5)


def ref_nystrom(q, k, v, lengths, m):
    """Per sequence, from the paper: segment means over the real tokens (token j of L in
    segment floor(j m / L); empty segments dropped) and the exact pseudo-inverse."""
    out = torch.zeros_like(v[..., :1].expand(*v.shape[:-1], v.shape[-1]))
    rows = []
    for i, L in enumerate(lengths):
        segs = [[j for j in range(L) if j * m // L == s] for s in range(m)]
        segs = [s for s in segs if s]
        qi, ki, vi = q[i, :, :L], k[i, :, :L], v[i, :, :L]
        ql = torch.stack([qi[:, s].mean(1) for s in segs], 1)  # (H, m', D)
        kl = torch.stack([ki[:, s].mean(1) for s in segs], 1)
        sm = lambda a, b: torch.softmax(a @ b.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
        yi = sm(qi, kl) @ torch.linalg.pinv(sm(ql, kl)) @ (sm(ql, ki) @ vi)
        rows.append(torch.cat([yi, out[i, :, L:]], 1))
    return torch.stack(rows)


@pytest.mark.parametrize("m", [5, 40])  # fewer landmarks than tokens; more than the short sequence
def test_nystrom_matches_reference(m):
    n, lengths = 33, [33, 21]
    layer = build("nystrom", landmarks=m, pinv_iterations=40, conv_kernel=None).double()
    q, k, v = qkv(n=n, m=6)
    mask = padding(2, n, lengths)
    out = layer.attend(q, k, v, False, mask)
    assert_close_fwd_bwd(out, ref_nystrom(q, k, v, lengths, m), (q, k, v), real_rows=~mask, atol=1e-6, rtol=1e-5)


def test_nystrom_conv_skip_is_a_depthwise_conv_of_v():
    layer = build("nystrom", landmarks=4, conv_kernel=5).double()
    q, k, v = qkv(h=4, n=17, m=8)
    without = build("nystrom", landmarks=4, conv_kernel=None).double()
    w = layer.conv.weight[:, 0, :, 0]  # (H, 5)
    skip = torch.stack([F.conv1d(v[:, h].transpose(1, 2), w[h].expand(8, 1, 5), padding=2, groups=8).transpose(1, 2)
                        for h in range(v.shape[1])], 1)
    torch.testing.assert_close(layer.attend(q, k, v, False, None), without.attend(q, k, v, False, None) + skip)


# ------------------------------------------------------------------ BigBird / Longformer

def bigbird_allowed(layer, n, real):
    """The pattern from its definition, position by position: (B, 1, N, N) bool."""
    blk, w, g = layer.block, layer.window, min(layer.global_tokens, n)
    nb = math.ceil(n / blk)
    rand_idx, rand_ok = layer.random_index(nb) if layer.random_blocks else (torch.zeros(nb, 0, dtype=torch.long),) * 2
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            qb, kb = i // blk, j // blk
            random = any(int(r) == kb and bool(ok) for r, ok in zip(rand_idx[qb], rand_ok[qb]))
            allowed[i, j] = i < g or j < g or abs(qb - kb) <= w or random
    return allowed[None, None] & real[:, None, None, :]


@pytest.mark.parametrize("global_tokens", [0, 3])
def test_bigbird_window_covering_the_sequence_is_softmax(global_tokens):
    n, blk = 37, 8  # 5 blocks: a window of 4 blocks either side covers every pair
    layer = build("bigbird", block=blk, window=4, global_tokens=global_tokens, random_blocks=0).double()
    q, k, v = qkv(n=n, m=5)
    mask = padding(2, n, [37, 22])
    out = layer.attend(q, k, v, False, mask)
    ref = ref_attention(q, k, v, (~mask)[:, None, None, :])
    assert_close_fwd_bwd(out, ref, (q, k, v), real_rows=~mask)


@pytest.mark.parametrize("window,global_tokens,random_blocks", [(1, 0, 0), (1, 5, 2), (0, 2, 3), (2, 9, 1)])
def test_bigbird_matches_dense_reference(window, global_tokens, random_blocks):
    n, blk = 53, 6  # 9 blocks, the last one partial
    layer = build("bigbird", block=blk, window=window, global_tokens=global_tokens,
                  random_blocks=random_blocks).double()
    q, k, v = qkv(n=n, m=4)
    mask = padding(2, n, [53, 40])
    out = layer.attend(q, k, v, False, mask)
    ref = ref_attention(q, k, v, bigbird_allowed(layer, n, ~mask))
    assert_close_fwd_bwd(out, ref, (q, k, v), real_rows=~mask)


def test_bigbird_random_blocks_are_outside_the_window_and_distinct():
    layer = build("bigbird", window=1, random_blocks=3)
    idx, ok = layer.random_index(12)
    for i in range(12):
        drawn = idx[i][ok[i]].tolist()
        assert len(drawn) == 3 and len(set(drawn)) == 3 and all(abs(j - i) > 1 for j in drawn)
    again, _ = layer.random_index(12)
    assert torch.equal(idx, again)  # deterministic for a layer
    idx3, ok3 = layer.random_index(3)  # nothing outside the window of the middle block
    assert not ok3[1].any()


# ------------------------------------------------------------------ Long-Short

def ref_longshort(layer, q, k, v, real):
    """Dense float64 form: a (N, r + N) softmax per query with the window as a mask."""
    n, w = q.shape[2], layer.window
    s = torch.einsum("bhnd,hdr->bhnr", k, layer.W_P).masked_fill(~real[:, None, :, None], -math.inf)
    P = torch.softmax(s, 2)  # over the sequence
    k_long, v_long = layer.ln_long_k(P.transpose(-1, -2) @ k), layer.ln_long_v(P.transpose(-1, -2) @ v)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    start = (i // w) * w
    window = (j >= start - w // 2) & (j < start + w + w // 2)  # (N, N)
    keys = torch.cat([k_long, layer.ln_short_k(k)], 2)
    values = torch.cat([v_long, layer.ln_short_v(v)], 2)
    allowed = torch.cat([torch.ones(real.shape[0], 1, n, layer.rank, dtype=torch.bool),
                         window[None, None] & real[:, None, None, :]], -1)
    return ref_attention(q, keys, values, allowed)


@pytest.mark.parametrize("window", [6, 7])
def test_longshort_matches_dense_reference(window):
    n = 41
    layer = build("longshort", window=window, rank=4).double()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    q, k, v = qkv(n=n, h=4, m=8)
    mask = padding(2, n, [41, 25])
    out = layer.attend(q, k, v, False, mask)
    assert_close_fwd_bwd(out, ref_longshort(layer, q, k, v, ~mask), (q, k, v), real_rows=~mask)
