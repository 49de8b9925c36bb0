"""torch.compile for training (trainer.compile) and for generation (compile_step), on CPU.
The tests use the cheap "eager"/"aot_eager" backends: they run TorchDynamo's capture (and, for
aot_eager, AOTAutograd's forward/backward graphs) without inductor's C++ code generation, which
takes minutes on this 2-core machine; inductor is the default for real runs."""
from functools import partial

import pytest
import torch

from repro.attention import LinearAttention
from repro.common.errors import ConfigError
from repro.common.results import read_jsonl
from repro.models import AutoregressiveTransformer
from repro.models.generate import generate
from repro.tasks.copy import run
from repro.training.loop import compile_step

pytestmark = pytest.mark.slow  # torch.compile

BASE = ("experiment=smoke_copy", "attention=linear", "task.max_len=12", "task.batch_size=4", "model.n_layers=1",
        "model.d_model=16", "model.n_heads=2", "model.d_ff=16", "trainer.max_steps=3", "trainer.log_every=1",
        "trainer.eval_every=0", "trainer.checkpoint=false", "trainer.progress=false")


def losses(compose_cfg, out, *overrides):
    run(compose_cfg(*BASE, *overrides, f"+task.out_dir={out}"))
    rows = read_jsonl(out / "results.jsonl")
    return [r["loss"] for r in rows if r["kind"] == "train"], rows[-1]


# linear with aot_eager traces the forward and backward graphs through the chunked kernel's
# autograd.Function (it used to fail there: elu's backward on a transposed input, whose meta
# strides disagree with its CPU kernel; the attention now makes q and k contiguous first).
@pytest.mark.parametrize("attention,backend", [("softmax", "aot_eager"), ("linear", "aot_eager"), ("linear", "eager")])
def test_compiled_training_takes_the_same_steps(compose_cfg, tmp_path, attention, backend):
    plain, _ = losses(compose_cfg, tmp_path / "plain", f"attention={attention}")
    compiled, final = losses(compose_cfg, tmp_path / "compiled", f"attention={attention}", "trainer.compile=true",
                             f"trainer.compile_backend={backend}")
    assert compiled == pytest.approx(plain, rel=1e-5) and final["compile_backend"] == backend
    assert plain[0] != plain[-1]  # it did train


def test_bad_compile_settings_fail_in_one_line(compose_cfg, tmp_path):
    with pytest.raises(ConfigError, match="trainer.compile_backend='nope'; valid: .*aot_eager"):
        losses(compose_cfg, tmp_path, "trainer.compile=true", "trainer.compile_backend=nope")
    with pytest.raises(ConfigError, match="trainer.compile must be true or false"):
        losses(compose_cfg, tmp_path, "trainer.compile=3")


def test_compiled_step_generates_the_same_tokens():
    model = AutoregressiveTransformer(partial(LinearAttention), 11, n_layers=1, d_model=16, n_heads=2, d_ff=16).eval()
    prefix = torch.randint(1, 11, (3, 2))
    ref = generate(model, prefix, 6, lambda y: y.argmax(-1))
    compile_step(model, backend="eager")
    assert torch.equal(generate(model, prefix, 6, lambda y: y.argmax(-1)), ref)


@pytest.mark.parametrize("norm_first", [False, True])
def test_generation_step_traces_as_one_graph(norm_first):
    """The whole step (embedding, every layer, head) is one graph with no break: a break splits
    it into graphs with Python between them, the per-token overhead compiling is meant to remove
    (the fused q/k/v weight cache, keyed on data pointers, used to cause one per layer)."""
    import torch._dynamo
    model = AutoregressiveTransformer(partial(LinearAttention), 11, n_layers=2, d_model=16, n_heads=2, d_ff=16,
                                      norm_first=norm_first).eval()
    tokens = torch.randint(0, 11, (3,))
    _, state = model.step(tokens)  # the steady-state step, with a state to update
    explained = torch._dynamo.explain(type(model).step.__get__(model))(tokens, state)
    assert (explained.graph_break_count, explained.graph_count) == (0, 1), explained.break_reasons


@pytest.mark.parametrize("name", ["linear", "softmax"])
def test_compiled_step_is_not_recompiled_per_position(name):
    """Sampling 20 tokens through the compiled step compiles two graphs (the first step, which
    builds the state, and every later one), not one per position: the softmax cache's write
    position used to be specialized."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from repro.attention import SoftmaxAttention
    att = partial(LinearAttention) if name == "linear" else partial(SoftmaxAttention, initial_cache=32)
    model = AutoregressiveTransformer(att, 11, n_layers=2, d_model=16, n_heads=2, d_ff=16).eval()
    ref = generate(model, torch.zeros(2, 1, dtype=torch.long), 20, lambda y: y.argmax(-1))
    torch._dynamo.reset()
    counters.clear()
    compile_step(model, backend="eager")
    assert torch.equal(generate(model, torch.zeros(2, 1, dtype=torch.long), 20, lambda y: y.argmax(-1)), ref)
    assert counters["stats"]["unique_graphs"] <= 2



def _sampler(y):
    """Draws from softmax(y) with torch's generator: the same draws eagerly and through a
    compiled graph run by the eager backend, so both generations must agree token for token."""
    return torch.multinomial(torch.softmax(y.double(), -1), 1)[:, 0]


def _greedy(y):
    return y.argmax(-1)


def _tiny(dtype=torch.float32, attention="linear"):
    from repro.attention import SoftmaxAttention
    torch.manual_seed(0)
    att = partial(LinearAttention) if attention == "linear" else partial(SoftmaxAttention, initial_cache=32)
    return AutoregressiveTransformer(att, 11, n_layers=2, d_model=16, n_heads=2, d_ff=16).eval().to(dtype)


@pytest.mark.parametrize("attention,tokens_per_call,length", [("linear", 2, 17), ("linear", 3, 17), ("linear", 1, 9),
                                                              ("softmax", 2, 17)])
def test_sampling_inside_the_compiled_step_draws_what_eager_draws(attention, tokens_per_call, length):
    """generate through model.sampling_step (one token first, then tokens_per_call at a time,
    a short tail one by one) against plain eager generation with the same seed; the prefix of 2
    goes through model.step. Another sample_fn than the compiled one samples outside the
    compiled plain step."""
    model = _tiny(attention=attention)
    prefix = torch.randint(1, 11, (3, 2))
    refs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        refs.append(generate(model, prefix, length, _sampler))
    greedy = generate(model, prefix, length, _greedy)
    with pytest.raises(ValueError, match="tokens_per_call must be >= 1; got 0"):
        compile_step(model, backend="eager", sample_fn=_sampler, tokens_per_call=0)
    compile_step(model, backend="eager", sample_fn=_sampler, tokens_per_call=tokens_per_call)
    assert model.sampling_step.tokens_per_call == tokens_per_call
    for seed, ref in zip((0, 1), refs):
        torch.manual_seed(seed)
        assert torch.equal(generate(model, prefix, length, _sampler), ref)
    assert torch.equal(generate(model, prefix, length, _greedy), greedy)


def test_compiled_generation_follows_new_weights_dtypes_and_batch_sizes():
    """The compiled step reads the fused q/k/v weights as cached: a later generation after the
    weights changed (load_state_dict, an optimizer step), at another batch size or in float64
    must still equal eager generation."""
    model, other = _tiny(), _tiny()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    compile_step(model, backend="eager", sample_fn=_greedy)
    eager = _tiny()

    def check(batch):
        prefix = torch.randint(1, 11, (batch, 1))
        ref = generate(eager, prefix, 14, _greedy)
        assert torch.equal(generate(model, prefix, 14, _greedy), ref)

    check(2)
    check(5)
    model.load_state_dict(other.state_dict())
    eager.load_state_dict(other.state_dict())
    check(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(torch.randint(0, 11, (2, 6))).square().mean().backward()
    opt.step()
    model.eval()
    eager.load_state_dict(model.state_dict())
    check(3)
    model.double()
    eager.double()
    check(2)


def test_compile_step_with_inductor_generates_what_eager_generates():
    """The settings the real runs use (inductor, its store-not-recompute thresholds and, on
    CPU, the C++ wrapper), on a tiny model: greedy tokens equal eager generation's."""
    model = _tiny()
    prefix = torch.randint(1, 11, (2, 1))
    ref = generate(model, prefix, 12, _greedy)
    compile_step(model, backend="inductor", sample_fn=_greedy)
    assert torch.equal(generate(model, prefix, 12, _greedy), ref)
    assert torch.equal(generate(model, prefix, 12, _greedy), ref)


def test_a_compiled_generation_longer_than_the_warm_up_does_not_recompile():
    """The throughput task warms the compiled step up on two short generations (one ending in
    a single-token tail), then times a whole image under fail_on_recompile. At batch 1 a column
    of the (1, length) token buffer has stride (length,) and counts as contiguous, so the step
    must not see that stride."""
    import torch._dynamo

    from repro.tasks.throughput import compile_generation
    model = _tiny()
    compile_generation(model, "eager", 784, 1, torch.device("cpu"), sample_fn=_greedy)
    first = torch.zeros(1, 1, dtype=torch.long)
    with torch.compiler.set_stance("fail_on_recompile"):
        for length in (31, 30):
            generate(model, first, length, _greedy)
    torch._dynamo.reset()  # warmed on one length only, the buffer's stride must not be a guard
    model = compile_step(_tiny(), backend="eager", sample_fn=_greedy)
    for _ in range(2):
        generate(model, first, 8, _greedy)
    with torch.compiler.set_stance("fail_on_recompile"):
        generate(model, first, 30, _greedy)
