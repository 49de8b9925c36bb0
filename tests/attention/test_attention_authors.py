"""The authors' choices where the paper is silent (conf/experiment/paper_authors.yaml), each
against an independent reference: LSH rounds averaged (= the mean of single-round layers with
the same hyperplanes), hyperplanes shared across heads (= a per-head layer given the same planes
for every head) and redrawn at every call, attention dropout (off in eval, unbiased in training),
and the presets that switch them on."""
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from repro.attention import SoftmaxAttention
from repro.attention.lsh import LSHAttention
from repro.conf import CONF_DIR

SMALL = dict(n_buckets=4, chunk_size=8)  # N = 37 spans several chunks and buckets


def lsh(**kw):
    return LSHAttention(24, 3, **{**SMALL, **kw}).double()


def _copy(source, layer, rotations):
    """`layer` with the projections of `source` and the given hyperplanes."""
    layer.load_state_dict({**source.state_dict(), "rotations": rotations})
    return layer


@pytest.mark.parametrize("planes", ["per_head", "shared"])
@pytest.mark.parametrize("causal", [True, False])
def test_averaged_rounds_equal_the_mean_of_single_rounds_with_the_same_hashes(planes, causal):
    torch.manual_seed(1)
    layer = lsh(n_hashes=4, combine="mean", planes=planes, redraw="never").eval()
    x = torch.randn(2, 37, 24, dtype=torch.float64)
    singles = []
    for r in range(4):  # a one-round layer with the same weights and round r's hyperplanes
        one = lsh(n_hashes=1, planes=planes, redraw="never").eval()
        singles.append(_copy(layer, one, layer.rotations[r:r + 1].clone())(x, causal=causal))
    torch.testing.assert_close(layer(x, causal=causal), torch.stack(singles).mean(0), rtol=1e-10, atol=1e-12)
    # Reformer's log-sum-exp weights are another combination of the same rounds
    lse = _copy(layer, lsh(n_hashes=4, combine="lse", planes=planes, redraw="never").eval(), layer.rotations.clone())
    assert (lse(x, causal=causal) - torch.stack(singles).mean(0)).abs().max() > 1e-6


def test_shared_hyperplanes_hash_every_head_with_the_same_planes():
    torch.manual_seed(2)
    shared = lsh(n_hashes=2, planes="shared", redraw="never").eval()
    assert shared.rotations.shape == (2, 1, 8, 2)  # (rounds, one set for all heads, D, buckets / 2)
    k = F.normalize(torch.randn(2, 3, 37, 8, dtype=torch.float64), dim=-1)
    projected = torch.einsum("bhnd,rdk->rbhnk", k, shared.rotations[:, 0])  # by hand: k R for each round
    torch.testing.assert_close(shared._hash(k), torch.cat([projected, -projected], -1).argmax(-1), rtol=0, atol=0)
    # the same as a per-head layer given these planes for every head
    per_head = _copy(shared, lsh(n_hashes=2, planes="per_head", redraw="never").eval(),
                     shared.rotations.expand(-1, 3, -1, -1).clone())
    x = torch.randn(2, 37, 24, dtype=torch.float64)
    torch.testing.assert_close(shared(x, causal=True), per_head(x, causal=True), rtol=0, atol=0)


def test_redraw_always_draws_new_planes_at_every_call_even_in_eval():
    x = torch.randn(1, 37, 24, dtype=torch.float64)
    always = lsh(redraw="always", planes="shared").eval()
    before = always.rotations.clone()
    y1, y2 = always(x, causal=True), always(x, causal=True)
    assert not torch.equal(before, always.rotations) and not torch.equal(y1, y2)
    fixed = lsh(redraw="train").eval()  # ours: fixed in eval, so evaluation is deterministic
    torch.testing.assert_close(fixed(x, causal=True), fixed(x, causal=True), rtol=0, atol=0)
    never = lsh(redraw="never").train()
    torch.testing.assert_close(never(x, causal=True), never(x, causal=True), rtol=0, atol=0)
    assert lsh(redraw=True).redraw == "train" and lsh(redraw=False).redraw == "never"  # the former bool


@pytest.mark.parametrize("make", [lambda p: lsh(n_hashes=2, redraw="never", attention_dropout=p),
                                  lambda p: SoftmaxAttention(24, 3, attention_dropout=p).double()],
                         ids=["lsh", "softmax"])
def test_attention_dropout_is_off_in_eval_and_unbiased_in_training(make):
    torch.manual_seed(3)
    plain, dropped = make(0.0), make(0.3)
    dropped.load_state_dict(plain.state_dict())
    x = torch.randn(1, 37, 24, dtype=torch.float64)
    reference = plain.eval()(x, causal=True)
    torch.testing.assert_close(dropped.eval()(x, causal=True), reference, rtol=0, atol=0)
    dropped.train()
    with torch.no_grad():
        draws = torch.stack([dropped(x, causal=True) for _ in range(600)])
    assert (draws[0] - reference).abs().max() > 1e-3  # each draw drops weights ...
    # ... and E[dropout(A) / keep] = A: the mean over draws converges to the output without dropout
    err = (draws.mean(0) - reference).norm() / reference.norm()
    single = (draws[0] - reference).norm() / reference.norm()
    assert err < single / 8, (err.item(), single.item())


def test_bad_lsh_settings_get_one_line_errors():
    with pytest.raises(ValueError, match="unknown planes 'each'; valid: per_head, shared"):
        LSHAttention(16, 2, planes="each")
    with pytest.raises(ValueError, match="unknown redraw 'sometimes'; valid: train, always, never"):
        LSHAttention(16, 2, redraw="sometimes")
    with pytest.raises(ValueError, match=r"attention_dropout must be in \[0, 1\); got 1.5"):
        LSHAttention(16, 2, attention_dropout=1.5)
    with pytest.raises(ValueError, match=r"softmax: attention_dropout must be in \[0, 1\); got -0.1"):
        SoftmaxAttention(16, 2, attention_dropout=-0.1)


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


AUTHORS = {"combine": "mean", "planes": "shared", "redraw": "always", "attention_dropout": 0.1}
OURS = {"combine": "lse", "planes": "per_head", "redraw": "train", "attention_dropout": 0.0}


@pytest.mark.parametrize("experiment", ["paper_copy", "paper_mnist", "paper_cifar"])
def test_the_paper_presets_build_the_authors_attention(experiment):
    layer = instantiate(_compose(f"experiment={experiment}", "attention=lsh-4").attention)(d_model=256, n_heads=8)
    assert {k: getattr(layer, k) for k in AUTHORS} == AUTHORS
    assert (layer.n_hashes, layer.n_buckets) == (4, 64)
    softmax = instantiate(_compose(f"experiment={experiment}", "attention=softmax").attention)(d_model=256, n_heads=8)
    assert softmax.attention_dropout == 0.1
    # other presets keep ours
    layer = instantiate(_compose("task=copy", "attention=lsh-4").attention)(d_model=256, n_heads=8)
    assert {k: getattr(layer, k) for k in OURS} == OURS
    softmax = instantiate(_compose("task=copy", "attention=softmax").attention)(d_model=256, n_heads=8)
    assert softmax.attention_dropout == 0


def test_the_paper_sweeps_include_lsh():
    copy = _compose("experiment=paper_copy")
    assert copy.hydra.sweeper.params.attention.split(",") == ["softmax", "linear", "lsh-4"]
    lsh4 = instantiate(_compose("experiment=paper_copy", "attention=lsh-4").attention)(d_model=256, n_heads=8)
    assert (lsh4.n_hashes, lsh4.n_buckets, lsh4.chunk_size) == (4, 64, 32)  # Figure 2's LSH
    bench = _compose("experiment=paper_benchmark")
    assert {"lsh-1", "lsh-4", "lsh-8"} <= set(bench.task.attentions)
