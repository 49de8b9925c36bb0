"""task=scorecard: the paper's questions asked of one attention (is it as good as softmax and
linear on these tasks, how fast, how large), beside linear and softmax at the same commit and
settings. `python run.py -m experiment=scorecard attention=<name>` sweeps task.part over
conformance, figure1, copy, mnist, speech and generation (Hydra's basic launcher: in that order);
each job runs its part as single runs of the suite's own tasks, `python run.py <the part's
overrides> <the attention's overrides> hydra.run.dir=<dir>` (task.parts), and writes its summary,
scorecard_<part>.json, into the sweep dir; the card (repro/reproduction/report/scorecard.py) is
built from those at the sweep's end.

- The attention's settings reach every run unchanged: `attention=<name>` and every `attention.*`
  override of the command line (attention._target_ of a user's class included), and `device`.
- Conformance comes first; a failure stops the other parts (recorded as stopped, with why) unless
  task.go_on=true. A part that does not apply is skipped with its reason (speech needs a
  non-causal or bidirectional form, generation a recurrent one; the autoregressive parts a causal
  one). A part whose run fails is recorded as failed with the run's one-line error; the sweep
  goes on, and exits 1 at its end.
- Resuming: the attention's runs live beside the sweep dir (<sweep dir>.runs/<part>/<run>): a run
  that finished (its scorecard_run.json) is not repeated, one interrupted with a checkpoint
  continues from it (trainer.resume), and a part whose summary says ok is not run again. The same
  command (the same sweep dir) continues an interrupted card.
- Reference runs (task.references) are reused, not repeated: each lives in
  <task.refs_dir>/<git commit>/<hash>/, the hash of its overrides, the machine and the
  environment settings that change results (OMP_NUM_THREADS, REPRO_KERNEL); an uncommitted tree
  adds a hash of its diff to the commit. A second card at the same commit and settings (another
  attention, or the same again) reads them; a card waits for another that is running the same
  reference.
- Cards compare algorithms, not implementations: linear takes the fused C kernel on a CPU by
  default, while most attentions' ops are plain PyTorch. The timed parts named in task.torch_path
  also run linear on its PyTorch path (role linear-torch: attention=linear under REPRO_KERNEL=torch,
  a reference like the others).
"""
import fcntl
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from repro.common.errors import ConfigError, RunFailed
from repro.common.results import (
    RECORDED_ENV,
    REPO,
    atomic_write,
    device_name,
    git_sha,
    json_text,
    provenance,
    read_jsonl,
    run_command,
    run_load,
    write_jsonl,
)
from repro.conf import in_multirun, run_dir
from repro.conf.attention import attention_name, build_attention

PARTS = ("conformance", "figure1", "copy", "mnist", "speech", "generation")
SUBJECT = "attention"  # the role of the attention the card is for; the references' roles are their names
TORCH_PATH, TORCH_ENV = "linear-torch", {"REPRO_KERNEL": "torch"}  # linear on its PyTorch path (task.torch_path)
DONE = "scorecard_run.json"  # in a run's dir once it finished: what it ran and how long it took
OK, FAILED, SKIPPED, STOPPED = "ok", "failed", "skipped", "stopped"


def summary_path(card_dir, part: str) -> Path:
    return Path(card_dir) / f"scorecard_{part}.json"


def _key(line: str) -> str:
    return line.split("=", 1)[0].lstrip("+~")


def attention_overrides(cfg) -> list[str]:
    """The command line's attention (attention=<name>, every attention.* override) and device, as
    typed: what every run of the attention gets."""
    from hydra.core.hydra_config import HydraConfig

    lines = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    mine = [x for x in lines if _key(x) in ("attention", "device") or _key(x).startswith("attention.")]
    if not any(_key(x) == "attention" for x in mine):
        mine.insert(0, f"attention={attention_name(cfg)}")
    return mine


def hydra_value(v) -> str:
    """A Python value in Hydra's override grammar (strings quoted)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if re.fullmatch(r"[A-Za-z_/][A-Za-z0-9_./-]*", str(v)) and str(v).lower() not in ("true", "false", "null",
                                                                                       "nan", "inf"):
        return str(v)  # a plain name or path: as typed
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


# ----------------------------------------------------------------------------- the runs of a part

def forms(cfg) -> dict:
    """Which forms the attention has, from the layer built as the model builds it (a user's class
    need say nothing: it is then taken to have both forms and no step)."""
    from repro.attention.base import is_recurrent
    from repro.attention.noncausal import NonCausalAttention

    layer = build_attention(cfg, 64, 4)
    return {"causal": not isinstance(layer, NonCausalAttention),
            "non_causal": not getattr(layer, "causal_only", False),
            "bidirectional": getattr(layer, "causal_only", False) and hasattr(layer, "bidirectional"),
            "recurrent": is_recurrent(layer)}


def plan(cfg, part: str, subject: list[str]) -> tuple[list[dict], str | None]:
    """The runs of a part, each {role, cell, seed, overrides}, and why the part is skipped (None:
    it runs). The references run the same overrides with attention=<reference>."""
    t = cfg.task
    base = list(t.parts[part])
    if part != "conformance":
        have = forms(cfg)
        if part in ("figure1", "copy", "mnist", "generation") and not have["causal"]:
            return [], "non-causal only: this part runs the causal form"
        if part == "speech" and not (have["non_causal"] or have["bidirectional"]):
            return [], "causal only, with no non-causal or bidirectional form: the speech encoder is non-causal"
        if part == "generation" and not have["recurrent"]:
            return [], "no recurrent form (no step): generation runs the recurrent form"
        if part == "speech" and have["bidirectional"] and not have["non_causal"]:
            subject = subject + ["++attention.bidirectional=true"]
    device = [x for x in subject if _key(x) == "device"]
    roles = [(SUBJECT, subject)] + [(r, [f"attention={'linear' if r == TORCH_PATH else r}"] + device)
                                     for r in references(t, part)]
    if part == "generation":  # throughput runs named methods: the attention as one more, its settings per size
        roles = [(role, _generation(cfg, role, over)) for role, over in roles]
    cells = [(f"N = {n}", [f"task.max_len={n}"]) for n in t.copy_lengths] if part == "copy" else [(None, [])]
    seeds = list(t.seeds) if part in ("copy", "mnist", "speech") else [None]
    return [{"role": role, "cell": cell, "seed": seed, "env": TORCH_ENV if role == TORCH_PATH else {},
             "overrides": base + extra + over + ([f"seed={seed}"] if seed is not None else [])}
            for role, over in roles for cell, extra in cells for seed in seeds], None


def references(t, part: str) -> list[str]:
    """The reference roles of a part: task.references, and linear-torch where the part is timed
    (task.torch_path) and linear is a reference."""
    if part == "conformance":
        return []
    return list(t.references) + ([TORCH_PATH] if part in t.torch_path and "linear" in t.references else [])


# task=throughput's methods of the references
REF_METHODS = {"linear": "linear", TORCH_PATH: "linear", "softmax": "stateful-softmax"}


def _generation(cfg, role: str, over: list[str]) -> list[str]:
    if role != SUBJECT and role in REF_METHODS:
        return [f"task.run_methods=[{REF_METHODS[role]}]"] + [x for x in over if _key(x) == "device"]
    name = over[0].split("=", 1)[1] if role != SUBJECT else attention_name(cfg)
    chosen = {_key(x).split(".")[1] for x in over if _key(x).startswith("attention.")} if role == SUBJECT else set()
    node = OmegaConf.to_container(cfg.attention, resolve=True) if role == SUBJECT else {}
    settings = {k: {"mnist": node[k]} for k in sorted(chosen) if k in node}  # per size: the method's convention
    method = {"attention": name, "mode": "recurrent", **({"settings": settings} if settings else {})}
    return [f"+task.methods.card={hydra_value(method)}", "task.run_methods=[card]"] + \
        [x for x in over if _key(x) == "device"]


def tree_state() -> str:
    """The commit, and for an uncommitted tree a hash of its diff: what a reference run belongs to."""
    sha = git_sha()
    if sha.endswith("-dirty") and not os.environ.get("REPRO_GIT_SHA"):
        diff = subprocess.run(["git", "diff", "HEAD"], cwd=REPO, capture_output=True).stdout
        sha += "-" + hashlib.sha256(diff).hexdigest()[:8]
    return sha


def machine() -> str:
    import torch

    return device_name(torch.device("cpu")) if not torch.cuda.is_available() else torch.cuda.get_device_name()


def reference_dir(cfg, overrides: list[str], env: dict | None = None) -> tuple[Path, dict]:
    """Where a reference run lives, keyed by the commit and everything that changes its numbers."""
    key = {"commit": tree_state(), "overrides": overrides, "machine": machine(),
           "env": {k: (env or {}).get(k, os.environ.get(k)) for k in RECORDED_ENV}}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.task.refs_dir) / key["commit"] / digest, key


def _error_line(log: Path, rc: int) -> str:
    """The run's one-line error (run.py's `error: ...`), else its last line, never a traceback."""
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.is_file() else []
    errors = [x[len("error: "):] for x in lines if x.startswith("error: ")]
    if errors:
        return errors[-1]
    last = next((x for x in reversed(lines) if not x.startswith(("File ", "Traceback", "^", "~"))), None)
    return f"exit status {rc}" + (f": {last}" if last else "")


def run_py(argv: list[str], log: Path, env: dict | None = None) -> int:
    """`python run.py <argv>` in this working directory and environment (`env` set on top), its
    output to `log`."""
    with open(log, "w") as f:
        return subprocess.run([sys.executable, str(REPO / "run.py"), *argv], stdout=f, stderr=subprocess.STDOUT,
                              cwd=os.getcwd(), env={**os.environ, **(env or {})}).returncode


def local(path: Path) -> str:
    """`path` relative to the working directory when it lies in it, as the runs' folders are: a
    card names no folder of the machine it ran on."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def launch(overrides: list[str], where: Path, log: Path, env: dict | None = None) -> dict:
    """One `python run.py` run into `where`, unless it finished there before: {status, reason,
    dir, command, seconds, reused}. An interrupted training run continues from its checkpoint;
    one that left rows and no checkpoint is set aside (<dir>.interrupted-<n>) and run again."""
    done = where / DONE
    if done.is_file():
        return {**json.loads(done.read_text()), "reused": True}
    extra = []
    if (where / "checkpoints" / "last.pt").is_file():
        extra = [f"trainer.resume={hydra_value(str(where))}"]
    elif (where / "results.jsonl").is_file() and any(r.get("kind") in ("train", "eval", "final")
                                                    for r in read_jsonl(where / "results.jsonl")):
        n = 1 + sum(1 for _ in where.parent.glob(f"{where.name}.interrupted-*"))
        where.rename(where.parent / f"{where.name}.interrupted-{n}")
    argv = [*overrides, *extra, f"hydra.run.dir={hydra_value(str(where))}"]
    command = run_command(argv, env=env or {})  # as the card shows it: the reference's own settings alone
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  {command}\n    log: {log}", flush=True)
    start = time.perf_counter()
    rc = run_py(argv, log, env)
    seconds = time.perf_counter() - start
    result = {"status": OK if rc == 0 else FAILED, "reason": None if rc == 0 else _error_line(log, rc),
              "dir": str(where), "command": command, "seconds": round(seconds, 1), "log": local(log)}
    if rc == 0:
        atomic_write(done, json_text(result) + "\n")
    print(f"    {result['status']} in {seconds:.0f} s" + (f": {result['reason']}" if rc else ""), flush=True)
    return {**result, "reused": False}


def run_reference(cfg, overrides: list[str], log: Path, env: dict | None = None) -> dict:
    """A reference run from the cache, or run once into it (one card at a time per run: a card
    that finds another running it waits, then reads it)."""
    where, key = reference_dir(cfg, overrides, env)
    where.parent.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f".{where.name}.lock", "a") as held:
        if not (where / DONE).is_file():
            fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        result = launch(overrides, where, log, env)
    if result["status"] == OK and not (where / "key.json").is_file():
        atomic_write(where / "key.json", json_text(key, indent=1) + "\n")
    return result


# ----------------------------------------------------------------------------- what each part measures

def _rows(d) -> list[dict]:
    p = Path(d) / "results.jsonl"
    return read_jsonl(p) if p.is_file() else []


def _load(r: dict) -> dict:
    """A timed row's load over its run, where recorded: the card marks a time measured while the
    machine had more runnable processes than cores."""
    load = run_load(r)
    return {"load": load} if load is not None else {}


def measures(part: str, run: dict) -> list[dict]:
    """A finished run's numbers: [{measure, cell, value, lower_is_better, unit, judged, ...}]; a time
    carries its run's load average (`load`) where the run recorded one."""
    rows, cell = _rows(run["dir"]), run["cell"]
    out = []

    def add(measure, value, unit, judged=False, lower=True, **extra):
        if value is not None and value == value:  # not NaN
            out.append({"measure": measure, "cell": cell, "value": float(value), "unit": unit, "judged": judged,
                        "lower_is_better": lower, **extra})

    if part in ("copy", "mnist", "speech"):
        final = next((r for r in reversed(rows) if r.get("kind") == ("summary" if part == "speech" else "final")),
                     None)
        if final is None:
            return out
        steps = final.get("steps")
        if part == "copy":
            add("held-out loss", final.get("eval_loss"), "nats/symbol", judged=True, steps=steps)
            add("symbols right", 100 * final["eval_accuracy"] if "eval_accuracy" in final else None, "%",
                lower=False, steps=steps)
        elif part == "mnist":
            add("held-out bits/dim", final.get("eval_bits_per_dim"), "bits/dim", judged=True, steps=steps)
        else:
            add("validation PER", 100 * final["valid_per"] if "valid_per" in final else None, "%", judged=True,
                steps=steps)
            add("seconds per epoch", final.get("time_per_epoch_s"), "s", steps=steps, **_load(final))
        if part != "speech":
            add("time per update", final.get("time_per_step_ms"), "ms", steps=steps, **_load(final))
    elif part == "figure1":
        for r in rows:
            if r.get("task") == "benchmark" and r.get("status") == "ok":
                add("time per sample", r.get("time_per_sample_ms"), "ms", n=r["n"], **_load(r))
                add("peak memory per sample", r.get("mem_per_sample_mb"), "MB", n=r["n"])
                add("kept for backward per sample", r.get("saved_per_sample_mb"), "MB", n=r["n"])
    elif part == "generation":
        for r in rows:
            if r.get("task") == "throughput" and r.get("status") == "ok":
                if r["batch"] == 1:
                    add("seconds per image, batch 1", r["seconds_per_image"], "s", extrapolated=r.get("extrapolated"),
                        **_load(r))
                else:
                    add(f"images per second, batch {r['batch']}", r["images_per_s"], "images/s", lower=False,
                        extrapolated=r.get("extrapolated"), **_load(r))
    return out


def run_name(r: dict) -> str:
    """attention, linear-N64-seed0, ...: a run's folder and log name."""
    cell = r["cell"].replace(" ", "").replace("=", "") if r["cell"] else None
    return "-".join(x for x in (r["role"], cell, None if r["seed"] is None else f"seed{r['seed']}") if x)


def _conformance_table(run: dict) -> list[dict]:
    p = Path(run["dir"]) / "conformance.json"
    return json.loads(p.read_text()) if p.is_file() else []


# ----------------------------------------------------------------------------- the job

def card_dir(cfg) -> Path:
    """The sweep dir (a single run: its run dir), where every part's summary goes."""
    from hydra.core.hydra_config import HydraConfig

    if in_multirun():
        return Path(HydraConfig.get().sweep.dir)
    return run_dir(cfg)


def run(cfg) -> float:
    t = cfg.task
    if t.part not in PARTS:
        raise ConfigError(f"task.part={t.part!r}; valid: {', '.join(PARTS)}")
    bad = [p for p in PARTS if p not in t.parts]
    if bad:
        raise ConfigError(f"task.parts has no {bad[0]}; each part needs its overrides (conf/task/scorecard.yaml)")
    part, out, card = t.part, run_dir(cfg), card_dir(cfg)
    here = summary_path(card, part)
    if here.is_file() and json.loads(here.read_text()).get("status") == OK:
        print(f"scorecard {part}: done before ({here}), not repeated")
        return 0.0
    subject = attention_overrides(cfg)
    meta = {"task": "scorecard", "part": part, "attention": attention_name(cfg),
            "target": OmegaConf.select(cfg, "attention._target_", default=None), "quick": bool(t.quick),
            "label": "smoke test" if t.quick else None, "attention_overrides": subject,
            "references": references(t, part) or list(t.references), "seeds": list(t.seeds), "go_on": bool(t.go_on),
            "tolerance": OmegaConf.to_container(t.tolerance), "machine": machine(), "commit": git_sha(),
            "tree": tree_state(), "platform": platform.platform(), **provenance(_cpu())}
    summary = {**meta, "status": OK, "reason": None, "runs": [], "measures": [], "conformance": []}
    gate = summary_path(card, "conformance")
    if part != "conformance" and not t.go_on and gate.is_file():
        first = json.loads(gate.read_text())
        if first.get("status") != OK:
            summary.update(status=STOPPED, reason="not run: the attention failed conformance (above); "
                                                  "task.go_on=true runs it anyway")
    if summary["status"] == OK:
        try:
            runs, skip = plan(cfg, part, subject)
        except Exception as err:  # the attention cannot be built: conformance says more
            runs, skip = [], None
            summary.update(status=FAILED, reason=f"the attention cannot be built: {_one_line(err)}")
        if skip:
            summary.update(status=SKIPPED, reason=skip)
        print(f"scorecard {part}: {len(runs)} runs" + (f" ({summary['status']}: {summary['reason']})"
                                                      if summary["status"] != OK else ""), flush=True)
        for i, r in enumerate(runs):
            name = run_name(r)
            log = out / "logs" / f"{i:02d}-{name}.log"
            if r["role"] == SUBJECT:
                result = launch(r["overrides"], Path(f"{card}.runs") / part / name, log)
            else:
                result = run_reference(cfg, r["overrides"], log, r["env"])
            r.update(result)
            summary["runs"].append(r)
            if result["status"] == OK:
                summary["measures"] += [{**m, "role": r["role"], "seed": r["seed"]} for m in measures(part, r)]
            if part == "conformance":
                summary["conformance"] = _conformance_table(r)
        failed = [r for r in summary["runs"] if r["status"] != OK]
        if failed and summary["status"] == OK:
            which = f"{run_name(failed[0])}: " if len(summary["runs"]) > 1 else ""
            summary.update(status=FAILED, reason=f"{which}{failed[0]['reason']}"
                           + (f" (and {len(failed) - 1} more runs)" if len(failed) > 1 else ""))
    atomic_write(here, json_text(summary, indent=1) + "\n")
    write_jsonl(out / "results.jsonl", [{k: v for k, v in summary.items() if k not in ("runs", "measures",
                                                                                           "conformance")}])
    print(f"scorecard {part}: {summary['status']}" + (f": {summary['reason']}" if summary["reason"] else "")
          + f"\n  summary: {here}", flush=True)
    if summary["status"] == FAILED:
        raise RunFailed(f"scorecard part {part} failed: {summary['reason']}")
    return 0.0


def _one_line(err) -> str:
    text = (str(err).strip().splitlines() or [""])[0]
    return text if isinstance(err, ConfigError) else f"{type(err).__name__}: {text}"


def _cpu():
    import torch

    return torch.device("cpu")


def aggregate(rows, out_dir) -> float:
    """The parts at a glance (the card itself: python -m repro.report --scorecard <sweep dir>)."""
    by = {r["part"]: r for r in rows}
    for part in PARTS:
        if part in by:
            r = by[part]
            print(f"  {part:<12} {r['status']}" + (f": {r['reason']}" if r.get("reason") else ""))
    return float(sum(r["status"] == FAILED for r in rows))
