"""Loggers (conf/logger): where metrics go besides the rows every task writes to disk.
wandb is optional: `logger=wandb logger.mode=offline` works with no account or network."""
import csv
import os
from pathlib import Path


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
    """Appends every log() call to <run_dir>/metrics.csv (columns grow as new keys appear)."""

    def __init__(self, run_dir, run_config=None, filename: str = "metrics.csv", **_):
        super().__init__(run_dir)
        self.path = self.run_dir / filename
        self.rows: list[dict] = []

    def log(self, metrics, step=None):
        self.rows.append({"step": step, **metrics})
        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, keys)
            w.writeheader()
            w.writerows(self.rows)


class WandbLogger(NullLogger):
    def __init__(self, run_dir, run_config=None, project: str = "linear-attention-repro", entity: str | None = None,
                 mode: str = "offline", group: str | None = None, job_type: str | None = None,
                 name: str | None = None, tags: list | None = None, run_id: str | None = None, **_):
        super().__init__(run_dir)
        import wandb

        if mode not in ("online", "offline", "disabled"):
            from .config import ConfigError
            raise ConfigError(f"logger.mode={mode!r} is not valid; valid: online, offline, disabled")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb = wandb
        self.run = wandb.init(project=project, entity=entity, mode=mode, group=group, job_type=job_type,
                              name=name, tags=list(tags or []), config=run_config, dir=str(self.run_dir),
                              id=run_id, resume="allow" if run_id else None)

    def log(self, metrics, step=None):
        self.run.log(metrics, step=step)

    def log_table(self, name, rows):
        if rows:
            keys = list(dict.fromkeys(k for r in rows for k in r))
            self.run.log({name: self.wandb.Table(columns=keys, data=[[str(r.get(k)) for k in keys] for r in rows])})

    def log_image(self, name, path):
        self.run.log({name: self.wandb.Image(str(path))})

    def finish(self):
        self.run.finish()


def make_logger(cfg, run_dir):
    """The logger of conf/logger for this run, given the resolved config to record."""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    # Built by hand, not by instantiate(): the recorded config must reach wandb as plain data,
    # its _target_ entries unbuilt.
    kwargs = OmegaConf.to_container(cfg.logger, resolve=True)
    cls = get_class(kwargs.pop("_target_"))
    return cls(run_dir=run_dir, run_config=OmegaConf.to_container(cfg, resolve=True), **kwargs)
