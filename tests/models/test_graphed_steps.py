"""GraphedSteps (repro/models/generate.py): the whole recurrent step over static buffers, with the
position as a device tensor, samples the same sequence as eager generation (the same random
draws too: its probe and warm-up draw none of the generation's), for linear attention and its
successors, from prefixes of several lengths and again on a second generation; a key/value cache
is refused in one line. On a GPU the captured graph replays the same tokens as eager steps."""
import pytest
import torch
from hydra.utils import instantiate

from repro.conf import compose_group
from repro.models import AutoregressiveTransformer
from repro.models.generate import GraphedSteps, generate


def _model(name, device="cpu", dtype=torch.float64):
    att = instantiate(compose_group("attention", name))
    model = AutoregressiveTransformer(att, n_tokens=13, d_out=13, n_layers=3, d_model=32, n_heads=4, d_ff=48,
                                      dropout=0.1)
    return model.to(device, dtype).eval()


def sampled(y):  # random: the same draws must give the same tokens
    return torch.multinomial(torch.softmax(y.float(), -1), 1)[:, 0]


@pytest.mark.parametrize("name", ["linear", "retention", "gla", "delta"])
def test_static_steps_sample_what_eager_steps_sample(name):
    model = _model(name)
    graphed = GraphedSteps(model, sampled, capture=False)
    for k in (1, 3, 7):  # the second and third generations reuse the static buffers
        prefix = torch.randint(0, 13, (2, k))
        torch.manual_seed(k)
        eager = generate(model, prefix, 29, sampled)
        torch.manual_seed(k)
        seen = []
        static = generate(model, prefix, 29, sampled, graphed=graphed, on_step=seen.append)
        assert torch.equal(static, eager), (name, k)
        assert seen == list(range(k, 29))
    assert isinstance(graphed.state.position, torch.Tensor) and int(graphed.state.position) == 28


def test_a_static_cache_steps_as_the_growing_one_and_replays_as_one_graph():
    """softmax with static_cache: the same tokens as the growing cache (greedy, float64), the same
    draws through the static-buffer step, and a sequence past its slots refused in one line."""
    model = _model("softmax")
    prefix = torch.randint(0, 13, (3, 2))

    def greedy(y):
        return y.argmax(-1)

    growing = generate(model, prefix, 40, greedy)
    for layer in model.encoder.layers:
        layer.attention.static_cache, layer.attention.initial_cache = True, 40
    assert torch.equal(generate(model, prefix, 40, greedy), growing)
    graphed = GraphedSteps(model, sampled, capture=False)
    torch.manual_seed(0)
    eager = generate(model, prefix, 40, sampled)
    torch.manual_seed(0)
    assert torch.equal(generate(model, prefix, 40, sampled, graphed=graphed), eager)
    with pytest.raises(ValueError, match="static_cache holds initial_cache=40 tokens and this sequence is longer"):
        generate(model, prefix, 42, greedy)  # feeds 41 tokens
    with pytest.raises(ValueError, match="a static cache of initial_cache=40 slots cannot take 41 tokens"):
        generate(model, prefix, 42, sampled, graphed=graphed)  # refused before any replay


def test_the_position_as_a_tensor_reads_the_same_row():
    model = _model("linear")
    model._position(100, "cpu")
    for i in (0, 5, 99):
        assert torch.equal(model._position(torch.tensor(i), "cpu"), model._position(i, "cpu"))


def test_a_growing_cache_and_a_wrong_batch_are_refused_in_one_line():
    cache = GraphedSteps(_model("softmax"), sampled, capture=False)
    with pytest.raises(ValueError, match=r"changes from one token to the next .*not a growing key/value cache"):
        generate(cache.model, torch.zeros(2, 1, dtype=torch.long), 9, sampled, graphed=cache)
    graphed = GraphedSteps(_model("linear"), sampled, capture=False)
    generate(graphed.model, torch.zeros(2, 1, dtype=torch.long), 9, sampled, graphed=graphed)
    with pytest.raises(ValueError, match="made for batch 2, given 3"):
        generate(graphed.model, torch.zeros(3, 1, dtype=torch.long), 9, sampled, graphed=graphed)
    with pytest.raises(ValueError, match="their own sample_fn"):
        generate(graphed.model, torch.zeros(2, 1, dtype=torch.long), 9, torch.argmax, graphed=graphed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (a CUDA graph)")
@pytest.mark.parametrize("name", ["linear", "gla", "softmax"])
def test_a_captured_graph_replays_the_eager_steps(name):
    model = _model(name, "cuda", torch.float32)
    for layer in model.encoder.layers if name == "softmax" else ():  # the cache that one graph can replay
        layer.attention.static_cache, layer.attention.initial_cache = True, 200

    def greedy(y):  # deterministic: a graph's random draws need not match eager ones
        return y.argmax(-1)

    prefix = torch.randint(0, 13, (4, 2), device="cuda")
    graphed = GraphedSteps(model, greedy)
    for _ in range(2):
        assert torch.equal(generate(model, prefix, 200, greedy, graphed=graphed), generate(model, prefix, 200, greedy))
    assert graphed.graph is not None
    with torch.no_grad():  # a weight changed after capture: the fused q/k/v copy the graph reads is stale
        model.encoder.layers[0].attention.q_proj.weight.add_(1.0)
    with pytest.raises(ValueError, match="changed since the graph was captured"):
        generate(model, prefix, 200, greedy, graphed=graphed)


def test_throughput_times_a_graphed_method_and_names_what_it_cannot_replay(monkeypatch, compose_cfg):
    """task=throughput's `graph: true` path on the CPU (the capture left out): the step is
    captured before timing (graph_s), the row says the step was one graph, and a growing cache
    is an error row naming why, not a crash."""
    from repro.models import generate as gen
    from repro.tasks import throughput

    monkeypatch.setattr(throughput, "GraphedSteps", lambda model, fn: gen.GraphedSteps(model, fn, capture=False))
    cfg = compose_cfg("task=throughput", "model=tiny", "task.sizes=[mnist]", "task.batches=[2]")
    for name, ok in (("linear", True), ("softmax", False)):
        model = throughput.PixelTransformer(instantiate(compose_group("attention", name)), n_mixtures=2, n_layers=2,
                                            d_model=16, n_heads=2, d_ff=32, dropout=0.0).eval()
        row = throughput._measure(model, "recurrent", None, cfg.task, 40, 2, torch.device("cpu"), graph=True)
        if ok:
            assert row["status"] == "ok" and row["graph"] and row["graph_s"] > 0 and row["positions_measured"] == 39
        else:
            assert row["status"] == "error" and "not a growing key/value cache" in row["reason"]
    class Uncapturable(gen.GraphedSteps):
        def start(self, prefix, length):
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(throughput, "GraphedSteps", Uncapturable)
    row = throughput._measure(model, "recurrent", None, cfg.task, 40, 2, torch.device("cpu"), graph=True)
    assert row == {"status": "error", "reason": "graph=true: RuntimeError: operation not permitted when stream is "
                                                "capturing"}
    fields = throughput.kernel_fields(model, "recurrent", None, 2, 40, torch.float32, torch.device("cpu"), graph=True)
    assert fields["kernel_backend_why"].endswith("; the whole step replayed as one CUDA graph")
