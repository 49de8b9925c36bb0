"""Every timing row names the kernel it ran on (repro.training.backends): the answer checked
against the calls a forward and backward pass makes, and the rows of the benchmark, throughput
and kernels tasks; a run on the PyTorch path where a kernel exists says so once (the report's
column: tests/tasks/test_figure1_kernels.py)."""
import pandas as pd
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from repro.common.results import read_jsonl
from repro.conf.attention import attention_config
from repro.kernels.causal_product import cpu_native
from repro.kernels.normalised import cpu_layer
from repro.training.backends import layer_backend, note_fallback, product_backend, step_backend

needs_c = pytest.mark.skipif(cpu_native.library() is None, reason=f"no fused CPU kernel: {cpu_native.unavailable()}")


def _layer(name, d_model=32, n_heads=4):
    return instantiate(OmegaConf.create(attention_config(name)))(d_model=d_model, n_heads=n_heads)


def _ran(monkeypatch, layer, dtype):
    """What one forward + backward of `layer` called: 'cpu' when a fused C entry point ran, else
    'torch' (spies on the layer's fused CPU layer and the C product's entry points)."""
    calls = []
    for module, name in ((cpu_layer, "forward"), (cpu_native, "forward"), (cpu_native, "run_forward")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    x = torch.randn(2, 24, 32, dtype=dtype, requires_grad=True)
    layer.to(dtype)(x, causal=True).sum().backward()
    return "cpu" if calls else "torch"


@needs_c
@pytest.mark.parametrize("name, dtype", [("linear", torch.float32), ("linear", torch.bfloat16),
                                         ("linear", torch.float64), ("performer", torch.float32),
                                         ("softmax", torch.float32)])
def test_the_named_backend_is_the_one_that_runs(monkeypatch, name, dtype):
    layer = _layer(name)
    fields = layer_backend(layer, 2, 24, dtype, "cpu")
    assert fields["kernel_backend"] == _ran(monkeypatch, layer, dtype), fields
    assert not fields["kernel_fallback"]


@needs_c
def test_the_fused_cpu_layer_is_named_as_such():
    assert "fused CPU layer" in layer_backend(_layer("linear"), 2, 24, torch.float32, "cpu")["kernel_backend_why"]
    assert "causal product" in layer_backend(_layer("performer"), 2, 24, torch.float32, "cpu")["kernel_backend_why"]


@pytest.mark.parametrize("why", ["forced", "unavailable"])
def test_the_pytorch_path_where_a_kernel_exists_is_a_fallback_with_its_reason(monkeypatch, why):
    if why == "forced":
        monkeypatch.setenv("REPRO_KERNEL", "torch")
    else:
        monkeypatch.setattr(cpu_native, "_LIB", [None, "no C compiler (cc) on the PATH"])
    layer = _layer("linear")
    fields = layer_backend(layer, 2, 24, torch.float32, "cpu")
    assert fields["kernel_backend"] == "torch" == _ran(monkeypatch, layer, torch.float32)
    assert fields["kernel_fallback"]
    assert fields["kernel_backend_why"] == ("forced by REPRO_KERNEL=torch" if why == "forced" else
                                            "the fused CPU kernel is unavailable: no C compiler (cc) on the PATH")
    assert not layer_backend(layer, 2, 24, torch.float32, "cpu", causal=False)["kernel_fallback"]


def test_step_and_product_backends_on_a_cpu():
    assert step_backend(_layer("linear"), 4, torch.float32, "cpu")["kernel_backend"] == "torch"
    q = torch.randn(1, 2, 8, 4)
    expected = "cpu" if cpu_native.library() is not None else "torch"
    assert product_backend(q, q, q)["kernel_backend"] == expected
    assert product_backend(q.double(), q.double(), q.double())["kernel_backend_why"].startswith("float64")


def test_a_fallback_is_noted_once_per_label(capsys):
    fields = {"kernel_backend": "torch", "kernel_backend_why": "the fused CPU kernel is unavailable: x",
              "kernel_fallback": True}
    for _ in range(3):
        note_fallback("linear-test", fields)
    note_fallback("softmax-test", {**fields, "kernel_fallback": False})
    err = capsys.readouterr().err
    assert err.count("note: linear-test runs on the PyTorch path (slower): the fused CPU kernel is unavailable") == 1
    assert "softmax-test" not in err


def test_benchmark_throughput_and_kernels_rows_record_their_backend(compose_cfg, tmp_path, monkeypatch, capsys):
    """Without a C compiler linear attention ran on the PyTorch path, several times slower at small
    sizes, with no field in the rows and no word on the console."""
    from repro.tasks import benchmark, kernels, throughput

    monkeypatch.setattr(cpu_native, "_LIB", [None, "no C compiler (cc) on the PATH"])
    benchmark.run(compose_cfg("model=tiny", "task.tokens=64", "task.repeats=1", "task.warmup=0", "task.isolate=false",
                              "task.lengths=[16,32]", "task.attentions=[softmax,linear]",
                              f"+run_dir={tmp_path / 'b'}"))
    rows = {(r["attention"], r["n"]): r for r in read_jsonl(tmp_path / "b" / "results.jsonl")}
    assert rows["linear", 16]["kernel_backend"] == rows["linear", 32]["kernel_backend"] == "torch"
    assert rows["linear", 16]["kernel_fallback"] and "no C compiler" in rows["linear", 16]["kernel_backend_why"]
    assert rows["softmax", 16]["kernel_backend"] == "torch" and not rows["softmax", 16]["kernel_fallback"]
    assert capsys.readouterr().err.count("note: linear runs on the PyTorch path") == 1
    assert "linear: kernel torch (the fused CPU kernel is unavailable" in (tmp_path / "b" / "table.txt").read_text()
    assert "kernel_backend" in pd.read_csv(tmp_path / "b" / "benchmark.csv")

    throughput.run(compose_cfg("task=throughput", "model=tiny", "task.sizes=[mnist]", "task.batches=[1]",
                               "task.time_budget_s=0.1", "task.probes=2",
                               "task.run_methods=[linear,softmax,matvec-floor]", f"+run_dir={tmp_path / 't'}"))
    rows = {r["method"]: r for r in read_jsonl(tmp_path / "t" / "results.jsonl")}
    assert {m: r["kernel_backend"] for m, r in rows.items()} == {"linear": "torch", "softmax": "torch",
                                                                 "matvec-floor": "torch"}
    assert "step" in rows["linear"]["kernel_backend_why"]
    assert "linear: kernel torch" in (tmp_path / "t" / "throughput.txt").read_text()

    kernels.run(compose_cfg("task=kernels", "task.lengths=[16]", "task.implementations=[chunked,dispatcher,loop]",
                            "task.heads=1", "task.d=4", "task.m=4", "task.repeats=1", "task.warmup=0",
                            f"+run_dir={tmp_path / 'k'}"))
    rows = {r["implementation"]: r for r in read_jsonl(tmp_path / "k" / "results.jsonl")}
    assert rows["chunked"]["kernel_backend"] == rows["dispatcher"]["kernel_backend"] == "torch"
    assert rows["chunked"]["kernel_fallback"] and rows["loop"]["kernel_backend_why"] == "the reference (loop)"


def test_a_models_backend_is_its_attention_layers(monkeypatch):
    """What a training step's rows would carry (repro.training.backends.model_backend)."""
    from repro.models.autoregressive import AutoregressiveTransformer
    from repro.models.ctc import BiLSTMEncoder
    from repro.training.backends import model_backend

    model = AutoregressiveTransformer(instantiate(OmegaConf.create(attention_config("linear"))), n_tokens=12,
                                      n_layers=1, d_model=32, n_heads=4, d_ff=64)
    monkeypatch.setenv("REPRO_KERNEL", "torch")
    fields = model_backend(model, 8, 24, torch.float32, "cpu")
    assert fields["kernel_backend"] == "torch" and fields["kernel_fallback"]
    assert model_backend(BiLSTMEncoder(10, n_layers=1, hidden=8), 8, 24, torch.float32, "cpu") == {}


@pytest.mark.parametrize("kernel, expect", [(None, "cpu"), ("torch", "torch")])
def test_training_rows_record_the_kernel_their_steps_ran(compose_cfg, tmp_path, monkeypatch, capsys, kernel, expect):
    """Every row of a training run from its first step on names its attention's kernel; a run on
    the PyTorch path where the C kernel could run says so once on the console."""
    from repro.tasks.copy import run

    if kernel:
        monkeypatch.setenv("REPRO_KERNEL", kernel)
    elif not cpu_native.native(torch.device("cpu"), torch.float32):
        pytest.skip(f"no fused CPU kernel here: {cpu_native.unavailable()}")
    run(compose_cfg("experiment=smoke_copy", "attention=linear", "trainer.max_steps=4", "trainer.log_every=2",
                    "trainer.eval_every=0", "trainer.progress=false", "task.max_len=16", f"+task.out_dir={tmp_path}"))
    rows = read_jsonl(tmp_path / "results.jsonl")
    assert {r["kernel_backend"] for r in rows} == {expect} and rows[-1]["kind"] == "final"
    assert ("runs on the PyTorch path" in capsys.readouterr().err) == (kernel == "torch")
