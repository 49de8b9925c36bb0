"""Carrying a GPU node's results back: a remote or air-gapped node may return only a few files
of limited size from one folder, so everything the reproduction wrote goes into one archive (in
parts past PART_BYTES), and comes out here into the checkout, only under the folders it may write.
A training run cut before it finished travels too (its checkpoint and rows), so that the next
command resumes it on whatever node runs it."""
import io
import re
import shutil
import tarfile
from pathlib import Path

from repro.common.results import REPO
from repro.reproduction.jobs import finished_ok

PACKED = ("results/gpu", "outputs/gpu-smoke/results")  # what --pack takes, relative to the repository
# a cut training run of reproduce_gpu: outputs/gpu/<device>/<step>/<run>/ (its checkpoint and its rows so far)
RESUMABLE = re.compile(r"outputs/gpu(-smoke/runs|/[^/]+)/(copy|mnist)/[^/]+/(checkpoints/last\.pt|results\.jsonl)")
PACK_NAME = "gpu_results.tar.gz"
PART_BYTES = 15 << 20  # each file under 16 MiB, a common cap on what a remote node returns: larger goes in parts


def cut_runs(repo=REPO) -> list[Path]:
    """The files of the training runs a job cap cut (a checkpoint, and no `ok` in the step's
    jobs/<run>.json): each run's checkpoints/last.pt and results.jsonl, relative to `repo`. A run
    that finished keeps its rows in the results folder and needs neither."""
    repo, out = Path(repo), []
    for ckpt in sorted(repo.glob("outputs/gpu*/**/checkpoints/last.pt")):
        rel = ckpt.relative_to(repo).as_posix()
        if not RESUMABLE.fullmatch(rel):
            continue
        run = ckpt.parent.parent
        step, device = run.parent.name, run.parent.parent
        results = repo / ("outputs/gpu-smoke/results" if device.name == "runs" else f"results/gpu/{device.name}")
        if not finished_ok(results / step / "jobs" / f"{run.name}.json"):
            out += [p.relative_to(repo) for p in (ckpt, run / "results.jsonl") if p.is_file()]
    return out


def pack(dest, repo=REPO, part_bytes=PART_BYTES) -> list[Path]:
    """Everything this suite wrote under PACKED (step folders, logs, rows, figures; no checkpoint
    there), and the cut training runs (cut_runs), as one gzipped tar at the top of `dest`, its
    members relative to the repository, split into `<name>.partNN` files when over part_bytes.
    Returns the files written."""
    dest, repo = Path(dest), Path(repo)
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / PACK_NAME
    with tarfile.open(archive, "w:gz") as tar:
        for rel in PACKED:
            if (repo / rel).exists():
                tar.add(repo / rel, arcname=rel, filter=lambda m: None if m.name.endswith((".pt", ".ckpt")) else m)
        for rel in cut_runs(repo):
            tar.add(repo / rel, arcname=rel.as_posix())
    if archive.stat().st_size <= part_bytes:
        return [archive]
    data, parts = archive.read_bytes(), []
    archive.unlink()
    for i in range(0, len(data), part_bytes):
        parts.append(dest / f"{PACK_NAME}.part{i // part_bytes:02d}")
        parts[-1].write_bytes(data[i:i + part_bytes])
    return parts


def unpack(files, into=REPO) -> list[str]:
    """The archive pack() wrote (its file, or its parts in any order) extracted into `into`;
    only members under PACKED and cut runs' checkpoints and rows (RESUMABLE) are taken (no
    absolute paths, no '..', no links). Returns their names."""
    files = sorted(Path(f) for f in files)
    if not files:
        raise ValueError("--unpack: no files given")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"--unpack: no such file: {', '.join(missing)}")
    data = b"".join(f.read_bytes() for f in files)
    names = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            inside = any(m.name == p or m.name.startswith(p + "/") for p in PACKED) \
                or (m.isfile() and RESUMABLE.fullmatch(m.name))
            if not inside or m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
                raise ValueError(f"--unpack: {m.name!r} is not a file or folder under {', '.join(PACKED)}, "
                                 "nor a cut run's checkpoint or rows")
            names.append(m.name)
        tar.extractall(into, filter="data")
    forget_finished(into, names)
    return names


def forget_finished(into, names):
    """The local folders of cut runs that have since finished elsewhere (their job file, just
    unpacked, says ok): their rows are in the results now, and their checkpoints need not travel
    again."""
    into = Path(into)
    for name in names:
        m = re.fullmatch(r"results/gpu/([^/]+)/([^/]+)/jobs/([^/]+)\.json", name)
        if m and finished_ok(into / name):
            run = into / "outputs" / "gpu" / m[1] / m[2] / m[3]
            if (run / "checkpoints" / "last.pt").is_file():
                shutil.rmtree(run)
