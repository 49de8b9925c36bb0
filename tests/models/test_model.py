"""The paper's title as a test: the model run token by token through its recurrent twins
gives the same outputs as its parallel forward."""
import pytest
import torch
from hydra.utils import instantiate

from repro.conf import compose_group
from repro.models import AutoregressiveTransformer, Transformer, sinusoid


def _model(name, norm_first=False, dtype=torch.float64, embedding="sum"):
    att = instantiate(compose_group("attention", name))
    model = AutoregressiveTransformer(att, n_tokens=11, d_out=5, n_layers=3, d_model=32, n_heads=4,
                                      d_ff=48, dropout=0.1, norm_first=norm_first, embedding=embedding)
    return model.to(dtype).eval()  # eval: dropout off, as in generation


@pytest.mark.parametrize("name", ["softmax", "linear"])
@pytest.mark.parametrize("norm_first,embedding", [(False, "sum"), (True, "sum"), (False, "concat")])
def test_step_outputs_equal_parallel_forward(name, norm_first, embedding):
    model = _model(name, norm_first, embedding=embedding)
    tokens = torch.randint(0, 11, (3, 29))
    parallel = model(tokens)
    state, steps = None, []
    for t in range(tokens.shape[1]):
        y, state = model.step(tokens[:, t], state)
        steps.append(y)
    assert state.position == 29
    torch.testing.assert_close(torch.stack(steps, 1), parallel, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_model_is_causal(name):
    model = _model(name)
    tokens = torch.randint(0, 11, (2, 20))
    j = 12
    changed = tokens.clone()
    changed[:, j] = (changed[:, j] + 1) % 11
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :j], b[:, :j])
    assert (a[:, j] - b[:, j]).abs().max() > 1e-6  # and the change does reach position j


def test_model_trains_end_to_end():
    model = _model("linear", dtype=torch.float32).train()
    tokens = torch.randint(0, 11, (4, 16))
    out = model(tokens)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_encoder_non_causal_sees_the_future():
    att = instantiate(compose_group("attention", "linear"))
    enc = Transformer(att, n_layers=2, d_model=16, n_heads=2, d_ff=32, dropout=0.0).eval()
    x = torch.randn(1, 10, 16)
    x2 = x.clone()
    x2[0, -1] += 1
    assert (enc(x)[0, 0] - enc(x2)[0, 0]).abs().max() > 1e-6
    torch.testing.assert_close(enc(x, causal=True)[0, :-1], enc(x2, causal=True)[0, :-1])


def test_sinusoid_matches_formula():
    pos = torch.tensor([0, 3, 17])
    enc = sinusoid(pos, 6)
    for r, p in enumerate(pos.tolist()):
        for i in range(3):
            angle = p / 10000 ** (2 * i / 6)
            assert enc[r, 2 * i].item() == pytest.approx(torch.sin(torch.tensor(angle)).item(), abs=1e-6)
            assert enc[r, 2 * i + 1].item() == pytest.approx(torch.cos(torch.tensor(angle)).item(), abs=1e-6)


def _encoder_input(model, tokens):
    """What the model feeds its encoder (eval: no dropout), by its parallel forward and by its
    generation steps (a spy around the encoder's step; the real step still runs)."""
    seen, steps = [], []
    hook = model.encoder.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    model(tokens)
    hook.remove()
    step = model.encoder.step
    model.encoder.step = lambda x, states=None: (steps.append(x), step(x, states))[1]
    state = None
    for t in range(tokens.shape[1]):
        _, state = model.step(tokens[:, t], state)
    del model.encoder.step
    return seen[0], torch.stack(steps, 1)


@pytest.mark.parametrize("embedding", ["sum", "concat"])
def test_input_is_the_token_embedding_and_the_sinusoid_summed_or_concatenated(embedding):
    """concat (the authors' scripts): [a d/2 token embedding, a d/2 sinusoid] per position, built
    here by hand from the formula; sum: both d wide, added."""
    model = _model("linear", embedding=embedding)
    tokens = torch.randint(0, 11, (2, 9))
    width = 16 if embedding == "concat" else 32
    assert model.embed.weight.shape == (11, width)
    i = torch.arange(9, dtype=torch.float64)[:, None]
    angle = i / 10000 ** (torch.arange(0, width, 2, dtype=torch.float64) / width)  # (N, width / 2)
    pe = torch.stack([angle.sin(), angle.cos()], -1).flatten(-2)  # (N, width): sin, cos interleaved
    emb = model.embed.weight[tokens]  # (B, N, width)
    reference = torch.cat([emb, pe.expand(2, -1, -1)], -1) if embedding == "concat" else emb + pe
    parallel, stepwise = _encoder_input(model, tokens)
    assert parallel.shape == (2, 9, 32)
    torch.testing.assert_close(parallel, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stepwise, reference, rtol=1e-6, atol=1e-6)


def test_the_paper_presets_concatenate_and_other_presets_sum(compose_cfg):
    from repro.tasks.image import build_model
    for experiment, embedding in (("paper_mnist", "concat"), ("paper_copy", "concat"), ("mnist_cpu", "sum")):
        cfg = compose_cfg(f"experiment={experiment}", "attention=linear", "model.n_layers=1")
        assert cfg.model.embedding == embedding
    model = build_model(compose_cfg("experiment=paper_mnist", "attention=linear"), n_layers=1)
    assert model.embedding == "concat" and model.embed.weight.shape == (256, 128)


def test_bad_embedding_settings_are_named():
    att = instantiate(compose_group("attention", "linear"))
    with pytest.raises(ValueError, match="unknown embedding 'stack'; valid: sum, concat"):
        AutoregressiveTransformer(att, n_tokens=3, n_layers=1, d_model=8, n_heads=2, d_ff=8, embedding="stack")
    with pytest.raises(ValueError, match="d_model must be a multiple of 4, got 6"):
        AutoregressiveTransformer(att, n_tokens=3, n_layers=1, d_model=6, n_heads=2, d_ff=8, embedding="concat")


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="unknown activation 'swish'; valid: relu, gelu"):
        AutoregressiveTransformer(instantiate(compose_group("attention", "linear")), n_tokens=3,
                                  activation="swish", n_layers=1, d_model=8, n_heads=2, d_ff=8)


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_recurrent_and_rerun_generation_sample_the_same_sequence(name):
    from repro.models.generate import generate
    model = _model(name)
    prefix = torch.randint(0, 11, (3, 4))

    def greedy(y):  # deterministic, so both ways must agree token for token
        return y[:, :5].argmax(-1) * 2

    a = generate(model, prefix, 25, greedy, mode="recurrent")
    b = generate(model, prefix, 25, greedy, mode="rerun")
    assert torch.equal(a[:, :4], prefix) and torch.equal(a, b)
    with pytest.raises(ValueError, match="unknown mode 'beam'; valid: recurrent, rerun"):
        generate(model, prefix, 25, greedy, mode="beam")


def test_pixel_model_bits_per_dim_and_sequence_layout():
    from repro.models.pixels import PixelTransformer, to_images, to_sequence
    imgs = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8)
    seq = to_sequence(imgs)
    assert seq.shape == (2, 60) and seq[0, :3].tolist() == imgs[0, :, 0, 0].tolist()  # r, g, b interleaved
    assert torch.equal(to_images(seq, (3, 4, 5)), imgs)
    model = PixelTransformer(instantiate(compose_group("attention", "linear")), n_mixtures=4, n_layers=1,
                             d_model=16, n_heads=2, d_ff=16, dropout=0.0).double()
    nll = model.nll(seq)  # (B,): 59 predicted values each, the first is input only
    params = model(seq[:, :-1])
    from repro.models import logistic_mixture as dmol
    torch.testing.assert_close(nll, -dmol.log_prob(params, seq[:, 1:]).sum(-1))
    torch.testing.assert_close(model.bits_per_dim(seq), nll.mean() / (59 * torch.log(torch.tensor(2.0)).double()))


@pytest.mark.slow  # task=throughput with torch.compile
def test_throughput_task_runs_and_labels_extrapolation(compose_cfg, tmp_path):
    from repro.common.results import read_jsonl
    from repro.tasks import throughput
    cfg = compose_cfg("task=throughput", "model=tiny", "task.sizes=[mnist]", "task.batches=[2]",
                      "task.time_budget_s=0.3", "task.probes=3", "task.methods.linear-compiled.compile=eager",
                      "task.methods.stateful-softmax-compiled.compile=eager",
                      f"+run_dir={tmp_path}")
    throughput.run(cfg)
    rows = {r["method"]: r for r in read_jsonl(tmp_path / "results.jsonl")}
    assert set(rows) == {"linear", "linear-compiled", "stateful-softmax", "stateful-softmax-compiled", "softmax",
                         "lsh-1", "lsh-4", "matvec-floor"}
    assert rows["lsh-4"]["mode"] == "rerun" and rows["lsh-4"]["attention_settings"] == {"chunk_size": 29}
    assert rows["linear-compiled"]["compile"] == "eager" and rows["linear-compiled"]["compile_s"] > 0
    for r in rows.values():
        assert r["status"] == "ok" and r["seconds"] > 0 and r["images_per_s"] == pytest.approx(2 / r["seconds"])
        assert r["extrapolated"] == (r["positions_measured"] < 783) or r["mode"] == "floor"
    text = (tmp_path / "throughput.txt").read_text()
    assert "speed-up vs softmax" in text and "x floor @2" in text and "weights GB/s @2" in text


def test_matvec_floor_reads_every_weight_matrix_once():
    """The floor's matrices are exactly the step's: every Linear of the model (q, k, v fused),
    each once, so their bytes are the model's weights less the embedding and norms."""
    from repro.tasks.throughput import _matrices
    model = _model("linear", dtype=torch.float32)
    mats = _matrices(model)
    assert len(mats) == 4 * 3 + 1
    linear_bytes = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert sum(w.numel() * 4 for _, w in mats) == linear_bytes
    x = torch.randn(2, 32)
    a = model.encoder.layers[0].attention
    b, w = mats[0]
    torch.testing.assert_close(torch.addmm(b, x, w), torch.cat([a.q_proj(x), a.k_proj(x), a.v_proj(x)], -1))


def test_throughput_compile_settings_fail_in_one_line(compose_cfg, tmp_path):
    from repro.common.errors import ConfigError
    from repro.tasks import throughput
    base = ("task=throughput", "model=tiny", "task.sizes=[mnist]", f"+run_dir={tmp_path}")
    with pytest.raises(ConfigError, match="task.methods.linear-compiled.compile='nope'; valid: .*inductor"):
        throughput.run(compose_cfg(*base, "task.methods.linear-compiled.compile=nope"))
    with pytest.raises(ConfigError, match="task.methods.softmax.compile='eager': only a recurrent step"):
        throughput.run(compose_cfg(*base, "+task.methods.softmax.compile=eager"))
    with pytest.raises(ConfigError, match="mode='nope'; valid: recurrent, rerun, floor"):
        throughput.run(compose_cfg(*base, "task.methods.linear.mode=nope"))
    with pytest.raises(ConfigError, match="linear.graph=true: a CUDA graph replays an eager recurrent step on "
                                          "device=cuda; here mode=recurrent, compile=None, device=cpu"):
        throughput.run(compose_cfg(*base, "+task.methods.linear.graph=true"))
    with pytest.raises(ConfigError, match="softmax.graph=true: .*mode=rerun"):
        throughput.run(compose_cfg(*base, "+task.methods.softmax.graph=true"))


def test_throughput_runs_only_the_methods_run_methods_names(compose_cfg, tmp_path):
    """Methods added on the command line (the successors' recurrent twins) run, and only those
    task.run_methods names, not every default one; a label that is not a method is one line."""
    from repro.common.errors import ConfigError
    from repro.common.results import read_jsonl
    from repro.tasks import throughput
    base = ("task=throughput", "task.sizes=[mnist]", *[f"+task.methods.{a}={{attention: {a}, mode: recurrent}}"
                                                       for a in ("retention", "gla", "delta")],
            "task.run_methods=[linear,stateful-softmax,retention,gla,delta]",
            "model=tiny", "task.batches=[1]", "task.time_budget_s=0.2",
            "task.probes=2", "task.publish=null", f"+run_dir={tmp_path}")
    throughput.run(compose_cfg(*base))
    rows = {r["method"]: r for r in read_jsonl(tmp_path / "results.jsonl")}
    assert list(rows) == ["linear", "stateful-softmax", "retention", "gla", "delta"]
    assert all(r["status"] == "ok" and r["mode"] == "recurrent" and r["attention"] == m
               or m == "stateful-softmax" for m, r in rows.items())
    with pytest.raises(ConfigError, match=r"task.run_methods: unknown \['gated'\]; valid: linear, .*delta"):
        throughput.run(compose_cfg(*base, "task.run_methods=[linear,gated]"))


@pytest.mark.slow  # task=throughput with torch.compile
def test_throughput_failed_compile_is_an_error_row(compose_cfg, tmp_path):
    """A backend that cannot compile (inductor without a C++ compiler, say) leaves that row an
    error with its reason, and the other rows are still measured and tabled."""
    from torch._dynamo import list_backends
    from torch._dynamo.backends.registry import register_backend

    from repro.common.results import read_jsonl
    from repro.tasks import throughput

    if "repro_test_failing" not in list_backends(exclude_tags=()):
        @register_backend(name="repro_test_failing")
        def _failing(gm, example_inputs):
            raise RuntimeError("no C++ compiler here")

    cfg = compose_cfg("task=throughput", "model=tiny", "task.sizes=[mnist]", "task.batches=[1]",
                      "task.time_budget_s=0.2", "task.methods.linear-compiled.compile=repro_test_failing",
                      *(f"~task.methods.{m}" for m in ("stateful-softmax", "stateful-softmax-compiled", "softmax",
                                                        "lsh-1", "lsh-4", "matvec-floor")),
                      f"+run_dir={tmp_path}")
    throughput.run(cfg)
    rows = {r["method"]: r for r in read_jsonl(tmp_path / "results.jsonl")}
    assert rows["linear"]["status"] == "ok"
    assert rows["linear-compiled"]["status"] == "error"
    assert rows["linear-compiled"]["reason"].startswith("compile=repro_test_failing: ")
    assert "no C++ compiler here" in rows["linear-compiled"]["reason"]
    assert "linear-compiled (mnist, batch 1): not measured: compile=repro_test_failing: RuntimeError: no C++" in (
        tmp_path / "throughput.txt").read_text()


def test_the_paper_presets_drop_nothing_from_the_input_as_the_authors(compose_cfg):
    """The authors' copy and image scripts put no dropout on the input (embedding + position);
    the paper presets follow them, the layers keep their 0.1, and embedding_dropout=null gives
    the input the layers' rate (the option). In training mode a dropped input changes outputs."""
    from omegaconf import OmegaConf

    for preset in ("paper_copy", "paper_mnist"):
        m = compose_cfg(f"experiment={preset}").model
        assert (m.dropout, m.embedding_dropout) == (0.1, 0.0), preset
    kw = dict(OmegaConf.to_container(compose_cfg("experiment=paper_copy").model))
    kw.update(n_layers=1, d_model=16, n_heads=2, d_ff=16)
    att = instantiate(compose_group("attention", "linear"))
    paper = AutoregressiveTransformer(att, n_tokens=5, **kw)
    assert paper.dropout.p == 0.0 and paper.encoder.layers[0].dropout.p == 0.1
    assert AutoregressiveTransformer(att, n_tokens=5, **{**kw, "embedding_dropout": None}).dropout.p == 0.1
    paper.train()
    x = paper._input(paper.embed(torch.tensor([[1, 2, 3]])), sinusoid(torch.arange(3), paper.d_position))
    assert torch.equal(paper.dropout(x), x)  # nothing dropped from the input


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_generation_projections_follow_the_weights_and_step_aside_for_autograd(name):
    """Generation gives each recurrent layer StepProjections (q, k, v in one cached matmul). The
    step with them equals the plain step; after the weights change (an optimizer step, a
    load_state_dict) the cache is rebuilt, so the step follows the new weights; with autograd on
    the plain modules run and gradients reach every projection."""
    from repro.models.generate import StepProjections, fast_projections
    model = _model(name)
    tokens = torch.randint(0, 11, (3, 9))

    def run():
        state, out = None, []
        with torch.no_grad():
            for t in range(tokens.shape[1]):
                y, state = model.step(tokens[:, t], state)
                out.append(y)
        return torch.stack(out, 1)

    plain = run()
    layers = fast_projections(model)
    assert layers and all(isinstance(la.step_projections, StepProjections) for la in layers)
    torch.testing.assert_close(run(), plain, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        for la in layers:
            la.v_proj.weight.mul_(-1.5)  # in place: the version counter moves, the pointer stays
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})  # new storage too
    changed = run()
    assert (changed - plain).abs().max() > 1e-3
    for la in layers:
        la.step_projections = None
    torch.testing.assert_close(changed, run(), rtol=1e-12, atol=1e-12)
    fast_projections(model)
    la = layers[0]  # the model's step runs without autograd; a layer's own step may train
    y, _ = la.step(torch.randn(3, la.d_model, dtype=torch.float64))
    y.sum().backward()
    assert all(p.grad is not None for p in (la.q_proj.weight, la.k_proj.weight, la.v_proj.weight))


def test_throughput_table_of_several_runs_shows_their_range(tmp_path):
    """Rows of three runs of one command published together: each cell is their range with the
    count, and a speed-up compares medians."""
    from repro.tasks import throughput
    base = {"task": "throughput", "size": "mnist", "batch": 1, "length": 784, "n_layers": 8, "dtype": "float32",
            "device": "a CPU", "device_type": "cpu", "status": "ok", "extrapolated": False, "mode": "recurrent"}
    rows = [{**base, "method": m, "attention": a, "seconds_per_image": s, "images_per_s": 1 / s,
             "cpu_seconds_per_image": s} for m, a, times in (("stateful-softmax", "softmax", (62.0, 52.1, 54.5)),
                                                              ("linear", "linear", (42.4, 42.1, 42.5)))
            for s in times]
    throughput.aggregate(rows, tmp_path, publish=False)
    text = (tmp_path / "throughput.txt").read_text()
    assert "52.1-62 (3 runs)" in text and "42.1-42.5 (3 runs)" in text
    assert f"{54.5 / 42.4:.3g}x" in text  # the medians' ratio
