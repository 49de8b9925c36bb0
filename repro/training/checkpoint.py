"""Checkpoints: one file holding everything an exact resume needs (model, optimizer,
scheduler, step, data stream position, every RNG state, how many result rows preceded it, the
logging window, the last evaluation, and elapsed_s: the seconds of training so far, where a
resume's clock starts), written atomically (the whole file, then a rename), and read back with
one-line errors. Each file ends with a SHA-256 of everything before it, checked on load: a file
damaged after it was written (bytes zeroed, a bad copy) is refused, not resumed from.

Files are data, never code. The checksum catches damage, not intent (anyone can append a valid
one), so a checkpoint is read with torch.load(weights_only=True), which builds tensors and plain
values (numbers, strings, lists, tuples, dicts; collections.Counter, the dict of counts that
MultiStepLR keeps) and nothing else: a file naming any other object (a pickle whose __reduce__
would run code, a checkpoint holding pickled objects) is refused unread, in one line naming the
object. save_checkpoint writes only such values (`plain`: NumPy scalars and arrays become
numbers and tensors, paths strings; any other object is a TypeError at save, not at resume).
Checkpoints of the first format (repro-checkpoint-v1: no checksum, a fingerprint of the model
and attention alone) are refused with a line saying so: resume them with the commit that wrote
them, or train afresh."""
import hashlib
import io
import pickle
import random
import re
import warnings
from collections import Counter, OrderedDict
from pathlib import Path, PurePath

import numpy as np
import torch

from repro.common.errors import ConfigError
from repro.common.results import atomic_write

FORMAT = "repro-checkpoint-v2"
TRAILER = b"\nrepro-sha256:"  # + 64 hex digits + b"\n", after torch.save's bytes
LAST = "checkpoints/last.pt"  # relative to a run dir
# MultiStepLR's milestones: a dict of counts, nothing that runs code (torch >= 2.5 allows it already)
torch.serialization.add_safe_globals([Counter])
PLAIN = (type(None), bool, int, float, complex, str, bytes)


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict):
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def plain(x, where="checkpoint"):
    """x as torch.load(weights_only=True) reads it back: tensors, plain values and containers of
    them (a state_dict's OrderedDict keeps its _metadata); NumPy scalars and arrays as numbers and
    tensors, paths as strings. Any other object is a TypeError naming where it is."""
    if type(x) in PLAIN or isinstance(x, (torch.Tensor, torch.Size, torch.dtype)):
        return x
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.copy())
    if isinstance(x, PurePath):
        return str(x)
    if type(x) in (dict, OrderedDict, Counter):
        out = type(x)({plain(k, where): plain(v, f"{where}.{k}") for k, v in x.items()})  # (a Counter counts pairs)
        if hasattr(x, "_metadata"):
            out._metadata = plain(x._metadata, f"{where}._metadata")
        return out
    if type(x) in (list, tuple, set):
        return type(x)(plain(v, f"{where}[{i}]") for i, v in enumerate(x))
    raise TypeError(f"{where} is a {type(x).__module__}.{type(x).__qualname__}: a checkpoint holds tensors and "
                    "plain values only (numbers, strings, lists, tuples, dicts)")


def save_checkpoint(path, state: dict):
    buf = io.BytesIO()
    torch.save({"format": FORMAT, **plain(state)}, buf)
    data = buf.getvalue()
    atomic_write(path, data + TRAILER + hashlib.sha256(data).hexdigest().encode() + b"\n")


def _payload(path: Path) -> bytes:
    """torch.save's bytes, checked against the trailer's SHA-256 (None: the file has no trailer)."""
    data = path.read_bytes()
    cut = len(data) - len(TRAILER) - 65
    if cut < 0 or data[cut:cut + len(TRAILER)] != TRAILER:
        return None
    payload, digest = data[:cut], data[cut + len(TRAILER):-1].decode("ascii", "replace")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise ConfigError(f"checkpoint {path} is corrupt: its SHA-256 does not match the one written with it "
                          "(damaged after it was saved); resume from another checkpoint or train afresh")
    return payload


def find_checkpoint(path, option="trainer.resume") -> Path:
    """A checkpoint file, or a run dir holding checkpoints/last.pt (option: the setting that named
    it, for the error)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / LAST
    if not p.is_file():
        raise ConfigError(f"{option}={str(path)!r}: no checkpoint at {p} "
                          f"(give a checkpoint file or a run dir holding {LAST})")
    return p


def check_run_dir(run_dir, resume):
    """A run dir holding a checkpoint belongs to that run: training again there (from step 0)
    would overwrite its checkpoint and rows, so it is refused unless trainer.resume names that
    very checkpoint (continuing the run in place)."""
    mine = Path(run_dir) / LAST
    if mine.is_file() and not (resume and find_checkpoint(resume).resolve() == mine.resolve()):
        raise ConfigError(f"{run_dir} already holds a run's checkpoint ({mine}): continue that run with "
                          f"trainer.resume={run_dir}, or train afresh in a new run dir (leave hydra.run.dir unset, "
                          f"or name another)")



def run_dir_of(checkpoint: Path) -> Path:
    """The run dir a checkpoint file belongs to (<run dir>/checkpoints/last.pt, or a file beside
    its rows)."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent


def load_checkpoint(path, option="trainer.resume") -> dict:
    """The checkpoint that `option` (trainer.resume, task.checkpoint) names, read as data only."""
    path = find_checkpoint(path, option)
    payload = _payload(path)
    try:
        with warnings.catch_warnings():  # (a bare pickle's protocol: refused below in its own words)
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(io.BytesIO(payload) if payload is not None else path, map_location="cpu",
                               weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only load failed" not in str(err).lower():
            raise ConfigError(f"checkpoint {path} is corrupt or not a checkpoint: {_first_line(err)}") from err
        found = re.search(r"GLOBAL (\S+)", str(err)) or re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
        raise ConfigError(f"checkpoint {path} is not data only ({'it names ' if 'GLOBAL' in str(err) else ''}"
                          f"{found[1] if found else _first_line(err)}): refused unread, since loading it could run "
                          "code (a checkpoint holds tensors and plain values only); resume from a checkpoint this "
                          "suite wrote, or train afresh") from None
    except Exception as err:  # truncated, not a torch file, unpicklable: all the same to the user
        raise ConfigError(f"checkpoint {path} is corrupt or not a checkpoint: {_first_line(err)}") from err
    if isinstance(state, dict) and state.get("format") == "repro-checkpoint-v1":
        raise ConfigError(f"checkpoint {path} is of the first format (repro-checkpoint-v1: no checksum, and a "
                          "fingerprint of the model and attention alone, so its other settings cannot be checked); "
                          "resume it with the commit that wrote it, or train afresh")
    if isinstance(state, dict) and state.get("format") == FORMAT and payload is None:
        raise ConfigError(f"checkpoint {path} has lost its checksum (its end was cut off, or another tool rewrote "
                          f"it): it cannot be trusted; resume from another checkpoint or train afresh")
    if not isinstance(state, dict) or state.get("format") != FORMAT or payload is None:
        raise ConfigError(f"checkpoint {path} is not a {FORMAT} checkpoint "
                          f"(format {state.get('format') if isinstance(state, dict) else type(state).__name__!r})")
    state["path"] = path
    return state


def _first_line(err) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(err).__name__


def require(ckpt: dict, *keys):
    """A one-line refusal of a checkpoint that lacks what a training run writes (and a step that is
    not a count), rather than a KeyError later."""
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise ConfigError(f"checkpoint {ckpt['path']} holds no {', '.join(missing)}: it was not written by a "
                          "training run of this suite; give the run dir (or last.pt) of one")
    step = ckpt.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"checkpoint {ckpt['path']} is corrupt or not a checkpoint: its step is {step!r}")


def check_fingerprint(ckpt: dict, fingerprint: dict):
    """A checkpoint only resumes the run it came from: every setting but those that may change
    on a resume (repro.training.parts.MAY_CHANGE_ON_RESUME) as it was."""
    old = ckpt.get("fingerprint", {})
    diff = [k for k in sorted(set(old) | set(fingerprint)) if old.get(k) != fingerprint.get(k)]
    if diff:
        k = diff[0]
        raise ConfigError(f"checkpoint {ckpt['path']} does not match this run: {k} is {old.get(k)!r} there, "
                          f"{fingerprint.get(k)!r} here" + (f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""))


def load_into(ckpt: dict, name: str, obj):
    """obj.load_state_dict(ckpt[name]) with a one-line error naming the file."""
    try:
        obj.load_state_dict(ckpt[name])
    except (KeyError, RuntimeError, ValueError, TypeError) as err:
        msg = " ".join(str(err).split())
        raise ConfigError(f"checkpoint {ckpt['path']}: its {name} state does not fit this run: {msg[:240]}") from err
