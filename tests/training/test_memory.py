"""repro.training.memory.saved_bytes: what autograd keeps for backward, counted over distinct
storages, against sums written out by hand."""
import pytest
import torch
from torch import nn

from repro.common.errors import ConfigError
from repro.training.memory import layer_saved_mib, saved_bytes


def test_counts_each_saved_storage_once():
    x = torch.randn(7, 5, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    # x @ w keeps x and w; exp keeps its output; the view x[1:] shares x's storage
    nbytes, out = saved_bytes(lambda: ((x @ w).exp(), x[1:] * 2.0))
    assert nbytes == (7 * 5 + 5 * 3 + 7 * 3) * 4
    assert out[0].shape == (7, 3)


def test_parameters_count_and_nothing_is_kept_without_grad():
    layer = nn.Linear(16, 4).double()
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    nbytes, _ = saved_bytes(layer, x)
    assert nbytes == (3 * 16 + 4 * 16) * 8  # the input and the weight (the bias needs nothing)
    with torch.no_grad():
        assert saved_bytes(layer, x)[0] == 0
    assert layer_saved_mib(layer, torch.randn(3, 16, dtype=torch.float64)) == nbytes / 2**20


# ----------------------------------------------------------------------------- the timing tasks' memory limit

def test_memory_cap_turns_an_allocation_past_it_into_an_error_and_lifts_after():
    import resource

    import pytest

    from repro.training.memory import memory_cap, out_of_memory

    before = resource.getrlimit(resource.RLIMIT_AS)
    with memory_cap(64 * 2**20, torch.device("cpu")):
        small = torch.ones(1024, 1024)  # 4 MiB: fits
        with pytest.raises((RuntimeError, MemoryError)) as err:
            torch.empty(256 * 2**20 // 4).fill_(1.0)
        assert "allocate" in out_of_memory(err.value)
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert torch.empty(256 * 2**20 // 4).fill_(1.0).sum() > 0 and small.sum() == 1024 * 1024
    assert out_of_memory(ValueError("out of memory")) is None  # not an allocator's error
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")).startswith("CUDA")


def test_memory_limit_is_the_setting_or_most_of_what_is_free(monkeypatch):
    import psutil
    import pytest

    from repro.common.errors import ConfigError
    from repro.training.memory import memory_limit, over_limit

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 10 * 2**30}))
    assert memory_limit(None) == 8 * 2**30 and memory_limit(1.5) == 1.5 * 2**30
    for bad in (0, -1, "x", float("inf"), True):
        with pytest.raises(ConfigError, match="task.memory_limit_gb="):
            memory_limit(bad)
    assert over_limit(2**30, 2**31, "x") is None
    row = over_limit(3 * 2**30, 2**31, "linear at batch 9")
    assert row["status"] == "oom" and row["reason"].startswith("linear at batch 9 needs at least 3 GiB")


def _run(*args, tmp):
    from tests.run_cli import run_py

    proc = run_py(*args, f"hydra.run.dir={tmp}")
    assert proc.returncode == 0, proc.stderr
    from repro.common.results import read_jsonl
    return read_jsonl(tmp / "results.jsonl"), proc


@pytest.mark.slow  # run.py task=kernels, twice
def test_kernels_past_the_memory_limit_are_oom_rows_and_the_run_goes_on(tmp_path):
    """task.lengths=[10000000] allocated until the operating system's OOM killer ended the run.
    Now: refused from the estimate before allocating (the inputs alone need 76 GiB); and a point
    whose estimate fits but whose allocations pass the cap (the per-step loop keeps every state)
    is an 'oom' row, the next implementation measured."""
    rows, _ = _run("task=kernels", "task.lengths=[64,10000000]", "task.implementations=[chunked,naive]",
                   "task.repeats=1", "task.warmup=0", tmp=tmp_path / "a")
    assert [(r["n"], r["status"]) for r in rows] == [(64, "ok"), (64, "ok"), (10000000, "oom"), (10000000, "oom")]
    assert "needs at least 76.3 GiB" in rows[2]["reason"] and "estimated before allocating" in rows[2]["reason"]
    rows, proc = _run("task=kernels", "task.lengths=[512]", "task.implementations=[loop,chunked]", "task.repeats=1",
                      "task.warmup=0", "task.memory_limit_gb=0.1", tmp=tmp_path / "b")
    assert [(r["implementation"], r["status"]) for r in rows] == [("loop", "oom"), ("chunked", "ok")]
    assert "allocate" in rows[0]["reason"] and "loop N=512: oom" in proc.stderr
    assert (tmp_path / "b" / "kernels.csv").is_file()


def test_throughput_past_the_memory_limit_is_an_oom_row(compose_cfg, tmp_path, monkeypatch):
    """task.batches=[100000] allocated until the OOM killer: each method is refused from its
    estimate (a linear state or a key/value cache per layer for 100,000 images: over 1 GiB); with the estimate
    out of the way, the cap stops the allocation itself."""
    from repro.common.results import read_jsonl
    from repro.tasks import throughput

    base = ("task=throughput", "model=tiny", "task.sizes=[mnist]", "task.batches=[100000]", "task.time_budget_s=0.2",
            "task.probes=2")
    throughput.run(compose_cfg(*base, "task.run_methods=[linear,stateful-softmax,softmax]", "task.memory_limit_gb=1",
                               f"+run_dir={tmp_path}"))
    rows = read_jsonl(tmp_path / "results.jsonl")
    assert [r["status"] for r in rows] == ["oom"] * 3
    assert all("estimated before allocating" in r["reason"] for r in rows)
    monkeypatch.setattr(throughput, "needed_bytes", lambda *a: 0)
    throughput.run(compose_cfg(*base, "task.run_methods=[linear]", "task.memory_limit_gb=0.2",
                               f"+run_dir={tmp_path / 'cap'}"))
    row, = read_jsonl(tmp_path / "cap" / "results.jsonl")
    assert row["status"] == "oom" and "allocate" in row["reason"], row


def test_throughputs_estimate_takes_a_plain_attention_module():
    """A user's nn.Module (no n_heads, d_keys, d_values: not an AttentionLayer) has no state to
    estimate: the weights at least, where the estimate read its sizes and failed."""
    from conformance_attentions import TorchMultihead

    from repro.models.autoregressive import AutoregressiveTransformer
    from repro.tasks import throughput

    model = AutoregressiveTransformer(TorchMultihead, n_tokens=12, n_layers=2, d_model=32, n_heads=4, d_ff=64)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert throughput.needed_bytes(model, "recurrent", 3, 50) == weights
    assert throughput.needed_bytes(model, "floor", 3, 50) == weights + 3 * (32 + 64) * 4
    assert throughput.needed_bytes(model, "rerun", 3, 50) == weights + 3 * 50 * (8 + 2 * 64 * 4)


@pytest.mark.parametrize("task, key, value, expect", [
    ("throughput", "sizes", "[]", "task.sizes is empty; give at least one, e.g. task.sizes=[mnist]"),
    ("throughput", "batches", "[]", "task.batches is empty; give at least one, e.g. task.batches=[1,10]"),
    ("throughput", "batches", "[0,4]", "task.batches: [0] not positive integers; e.g. task.batches=[1,10]"),
    ("kernels", "lengths", "[]", "task.lengths is empty; give at least one, e.g. task.lengths=[1024,4096]"),
    ("kernels", "lengths", "[64,-1]", "task.lengths: [-1] not positive integers; e.g. task.lengths=[1024,4096]"),
    ("kernels", "implementations", "[]", "task.implementations is empty; name at least one of"),
])
def test_an_empty_or_bad_list_is_one_line(compose_cfg, tmp_path, task, key, value, expect):
    """These were tracebacks: an empty list of what to measure, or a length that is no length."""
    from repro.tasks import kernels, throughput

    run = {"throughput": throughput.run, "kernels": kernels.run}[task]
    with pytest.raises(ConfigError) as err:
        run(compose_cfg(f"task={task}", f"task.{key}={value}", f"+run_dir={tmp_path}"))
    assert str(err.value).startswith(expect) and "\n" not in str(err.value)
