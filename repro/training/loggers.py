"""Loggers (conf/logger): where metrics go besides the rows every task writes to disk.
wandb is optional: `logger=wandb logger.mode=offline` works with no account or network.

wandb runs are grouped by sweep (the sweep dir's name) or by experiment preset, their job_type
is the task, their config the resolved run config; a resumed training run continues the same
wandb run (its id travels in the checkpoint). At the end of a job (and of a sweep, after the
aggregation) repro.cli.callbacks logs the CSVs and PNGs of its directory: tables and figures.
"""
import contextlib
import csv
import math
import os
from pathlib import Path

RUN_ID_FILE = "wandb_run_id"  # in a run dir: the wandb run its rows went to


class NullLogger:
    def __init__(self, run_dir=None, run_config=None, **_):
        self.run_dir = Path(run_dir) if run_dir else None

    def log(self, metrics: dict, step: int | None = None):
        pass

    def log_table(self, name: str, rows: list[dict]):
        pass

    def log_image(self, name: str, path):
        pass

    def finish(self):
        pass


class CSVLogger(NullLogger):
    """Appends every log() call to <run_dir>/metrics.csv (columns grow as new keys appear). A
    resumed run (trainer.resume) starts from the metrics.csv beside the checkpoint it resumes:
    its rows before the first step this run logs (rows past the checkpoint, from a run killed
    after it, are logged again and replaced), as results.jsonl does, without that run's final row."""

    def __init__(self, run_dir, run_config=None, filename: str = "metrics.csv", **_):
        super().__init__(run_dir)
        self.path = self.run_dir / filename
        self.rows: list[dict] = []
        self.earlier = _resumed_metrics(run_config, filename, self.run_dir)

    def log(self, metrics, step=None):
        if self.earlier is not None:  # the first row of a resumed run: the earlier ones before it
            self.rows = [r for r in self.earlier if (step is None or r["step"] is None or r["step"] < step)
                         and not any(k.startswith("final/") for k in r)]  # an earlier segment's end: not this run's
            self.earlier = None
        self.rows.append({"step": step, **metrics})
        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, keys)
            w.writeheader()
            w.writerows(self.rows)


def _resumed_metrics(run_config, filename, run_dir) -> list[dict] | None:
    """The rows of the metrics CSV beside the checkpoint this run resumes (trainer.resume, or the
    run dir's own: a sweep's job run again in place), or None for a fresh run."""
    from repro.training.checkpoint import LAST, find_checkpoint, run_dir_of

    resume = ((run_config or {}).get("trainer") or {}).get("resume")
    resume = resume or (run_dir if (run_dir / LAST).is_file() else None)
    if not resume:
        return None

    try:
        ckpt = find_checkpoint(resume)
    except Exception:  # the trainer reports a bad trainer.resume in its own words
        return None
    source = run_dir_of(ckpt) / filename
    if not source.is_file():
        return []
    with open(source, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:  # back to numbers (csv gives strings; an empty cell: a key this row lacked)
        for k, v in list(r.items()):
            if v in ("", None):
                del r[k]
                continue
            with contextlib.suppress(ValueError):
                r[k] = int(float(v)) if k == "step" else float(v)
        r.setdefault("step", None)
    return rows


class WandbLogger(NullLogger):
    def __init__(self, run_dir, run_config=None, project: str = "linear-attention-repro", entity: str | None = None,
                 mode: str = "offline", group: str | None = None, job_type: str | None = None,
                 name: str | None = None, tags: list | None = None, run_id: str | None = None, **_):
        super().__init__(run_dir)
        import wandb

        if mode not in ("online", "offline", "disabled"):
            from repro.common.errors import ConfigError
            raise ConfigError(f"logger.mode={mode!r} is not valid; valid: online, offline, disabled")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb = wandb
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, entity=entity, mode=mode, group=group, job_type=job_type,
                              name=name or self.run_dir.name, tags=list(tags or []), config=run_config,
                              dir=str(self.run_dir), id=run_id, resume="allow" if run_id else None)
        if mode != "disabled":
            from repro.common.results import atomic_write
            atomic_write(self.run_dir / RUN_ID_FILE, self.run.id + "\n")

    def log(self, metrics, step=None):
        self.run.log(metrics, step=step)

    def log_table(self, name, rows):
        """rows: a list of dicts (columns: every key seen). Numbers stay numbers (sortable and
        plottable in the dashboard); nested values become text."""
        if rows:
            keys = list(dict.fromkeys(k for r in rows for k in r))
            data = [[_cell(r.get(k)) for k in keys] for r in rows]
            self.run.log({name: self.wandb.Table(columns=keys, data=data)})

    def log_image(self, name, path):
        self.run.log({name: self.wandb.Image(str(path))})

    def finish(self):
        self.run.finish()


def _cell(v):
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return None if math.isnan(v) else v
    return str(v)


def default_group(cfg) -> str | None:
    """Runs of one sweep share a group (the sweep dir's name); a single run is grouped by its
    experiment preset when it has one."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode.name == "MULTIRUN":
        return Path(hc.sweep.dir).name
    return hc.runtime.choices.get("experiment")


def run_config(cfg) -> dict:
    """The run's settings as plain data, resolved: every top-level node but `hydra`, which
    Hydra's callbacks pass too and which holds values only a sweep's job has (hydra.job.num)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    out = {}
    for key in cfg:
        if key != "hydra":
            value = cfg[key]  # a scalar interpolation resolves here
            out[key] = (OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig))
                        else value)
    return out


def make_logger(cfg, run_dir, **overrides):
    """The logger of conf/logger for this run, given the resolved config to record."""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    # Built by hand, not by instantiate(): the recorded config must reach wandb as plain data,
    # its _target_ entries unbuilt.
    kwargs = OmegaConf.to_container(cfg.logger, resolve=True)
    cls = get_class(kwargs.pop("_target_"))
    if cls is WandbLogger and kwargs.get("group") is None:
        kwargs["group"] = default_group(cfg)
    kwargs.update(overrides)
    return cls(run_dir=run_dir, run_config=run_config(cfg), **kwargs)


def publish_dir(cfg, out_dir, max_rows: int = 10_000, **overrides) -> bool:
    """Log every CSV (as a table) and PNG (as an image) directly in out_dir to wandb, into the
    run that wrote there (its id in out_dir/wandb_run_id) or a new one. A no-op for other loggers.
    Returns whether anything was logged."""
    import pandas as pd
    from hydra.utils import get_class

    out_dir = Path(out_dir)
    if cfg.get("logger") is None or get_class(cfg.logger._target_) is not WandbLogger:
        return False
    if cfg.logger.get("mode") == "disabled" or os.environ.get("WANDB_MODE") == "disabled":
        return False
    files = sorted(out_dir.glob("*.csv")) + sorted(out_dir.glob("*.png"))
    if not files:
        return False
    id_file = out_dir / RUN_ID_FILE
    if id_file.is_file() and "run_id" not in overrides:
        overrides["run_id"] = id_file.read_text().strip()
    logger = make_logger(cfg, out_dir, **overrides)
    for path in files:
        if path.suffix == ".csv":
            df = pd.read_csv(path).head(max_rows)
            logger.log_table(f"tables/{path.stem}", df.to_dict("records"))
        else:
            logger.log_image(f"figures/{path.stem}", path)
    logger.finish()
    return True
