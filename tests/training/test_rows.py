"""results.jsonl of a training run: appended row by row (bytes written linear in the rows), a torn
last line ignored, a resume keeps exactly the rows its checkpoint had seen, and the checkpoint
holds no rows."""
from functools import partial
from pathlib import Path

import pytest

from repro.tasks.copy import copy_loss
from repro.training import load_checkpoint
from repro.training.rows import read_rows
from tests.training.test_training import BASE, tiny_fit, train

IO = Path("/proc/self/io")


def bytes_written() -> int:
    """What this process has passed to write() so far (Linux's own count)."""
    return int(next(line.split()[1] for line in IO.read_text().splitlines() if line.startswith("wchar:")))


@pytest.mark.skipif(not IO.exists(), reason="needs Linux's /proc/self/io")
def test_bytes_written_grow_linearly_with_the_rows(compose_cfg, tmp_path):
    written = {}
    # one run first: a process's first run writes caches and warnings once, which are not rows
    tiny_fit(compose_cfg(*BASE, "trainer.max_steps=2", "trainer.eval_every=0", "trainer.checkpoint=false"),
             tmp_path / "warm-up")
    for n in (20, 80):  # a train row every step, no evaluation, no checkpoint: the rows are all it writes
        cfg = compose_cfg(*BASE, f"trainer.max_steps={n}", "trainer.eval_every=0", "trainer.checkpoint=false")
        before = bytes_written()
        tiny_fit(cfg, tmp_path / str(n))
        written[n] = bytes_written() - before
        size = (tmp_path / str(n) / "results.jsonl").stat().st_size
        assert len(read_rows(tmp_path / str(n) / "results.jsonl")) == n + 1  # n train rows and the final row
        # each row written once (rewriting the file per row would write ~n/2 times its size)
        assert size <= written[n] < 1.2 * size + 4096, (n, written[n], size)
    assert written[80] / written[20] < 4 * 1.2  # 4x the rows, 4x the bytes (quadratic: ~16x)


def test_a_torn_last_line_is_ignored(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # killed mid-write
    assert read_rows(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{"step": 2}')  # whole, only the newline missing
    assert read_rows(path) == [{"step": 1}, {"step": 2}]


def test_resume_truncates_to_the_checkpoints_rows(compose_cfg, tmp_path):
    """A run that dies after its step-4 checkpoint, having appended the rows of step 5 and half a
    line more: resumed in its own run dir, it holds the rows an uninterrupted run holds."""
    cfg = partial(compose_cfg, *BASE, "trainer.max_steps=6", "trainer.checkpoint_every=4")
    tiny_fit(cfg(), tmp_path / "whole")
    whole = read_rows(tmp_path / "whole/results.jsonl")
    run, calls = tmp_path / "run", []

    def crash_at_step_6(model, batch):
        calls.append(model.training)
        if sum(calls) == 6:
            raise RuntimeError("the machine went away")
        return copy_loss(model, batch)

    with pytest.raises(RuntimeError, match="went away"):
        tiny_fit(cfg(), run, crash_at_step_6)
    with open(run / "results.jsonl", "a") as f:
        f.write('{"task": "copy", "kind": "train", "st')  # and a kill -9 mid-write
    assert [r["step"] for r in read_rows(run / "results.jsonl")] == [1, 2, 3, 3, 4, 5]
    tiny_fit(cfg(f"trainer.resume={run}"), run)
    rows = read_rows(run / "results.jsonl")

    def key(rows):
        return [(r["kind"], r["step"], r.get("loss"), r.get("status")) for r in rows]

    assert key(rows) == key(whole)
    ckpt = load_checkpoint(run)
    assert "rows" not in ckpt and ckpt["rows_written"] == len(whole) - 1  # all but the final row


@pytest.mark.slow  # trains, then resumes
def test_checkpoint_size_does_not_grow_with_the_rows(compose_cfg, tmp_path):
    sizes = []
    for n in (4, 40):
        train(compose_cfg, tmp_path / str(n), f"trainer.max_steps={n}", "trainer.eval_every=0")
        sizes.append((tmp_path / str(n) / "checkpoints/last.pt").stat().st_size)
    assert abs(sizes[1] - sizes[0]) < 2048, sizes  # old checkpoints carried every row (~1 KB each)


def test_a_publish_folder_is_replaced_only_by_runs_that_include_its_own(tmp_path, monkeypatch):
    """A single run published into a folder holding a sweep's results (a probe with a claims
    preset) used to replace them: refused, the folder as it was; the same sweep again, or more of
    it, replaces them as before."""
    from repro.common import results
    from repro.common.errors import ConfigError

    monkeypatch.setattr(results, "REPO", tmp_path)
    sweep = [{"task": "copy", "attention": a, "seed": s, "max_len": 128, "publish": "pub"}
             for a in ("softmax", "linear") for s in (0, 1, 2)]
    assert results.output_dirs(sweep, tmp_path / "run", "copy_rows.jsonl")[1] == tmp_path / "pub"
    before = (tmp_path / "pub" / "copy_rows.jsonl").read_text()
    with pytest.raises(ConfigError, match="holds the results of 5 run\\(s\\) this one does not include"):
        results.output_dirs(sweep[3:4], tmp_path / "run", "copy_rows.jsonl")
    assert (tmp_path / "pub" / "copy_rows.jsonl").read_text() == before
    more = sweep + [{**sweep[0], "seed": 3}]
    results.output_dirs(more, tmp_path / "run", "copy_rows.jsonl")  # a superset: published
    assert len(results.read_jsonl(tmp_path / "pub" / "copy_rows.jsonl")) == 7
