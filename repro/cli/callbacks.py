"""Hydra callbacks: at the end of a multirun, gather every job's results.jsonl into the
sweep directory and let the task aggregate them (one CSV, one plot, one table). The aggregating
module is found from trusted configs (the running sweep's, the suite's conf/task), never from a
job folder's .hydra/config.yaml. With logger=wandb, each job's and the sweep's CSVs and figures
go to wandb as tables and images."""
import importlib
import sys
from collections import defaultdict
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from repro.common.results import read_jsonl, write_jsonl


def task_targets(config) -> list[str]:
    """The task targets this sweep may have run, from trusted configs only: its composed config's
    (task._target_), those its command line sweeps over (task._target_=a.run,b.run), and the
    suite's own task configs (conf/task: task=copy,mnist). Never a config found in a job folder:
    a file on disk names no code to import."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from repro.conf import CONF_DIR

    targets = [OmegaConf.select(config, "task._target_", default=None)]
    lines = OmegaConf.select(config, "hydra.overrides.task", default=None) or []
    for o in OverridesParser.create().parse_overrides(list(lines)):
        if o.key_or_group == "task._target_":
            targets += list(o.sweep_iterator()) if o.is_discrete_sweep() else [o.value()]
    targets += [OmegaConf.load(p).get("_target_") for p in sorted((CONF_DIR / "task").glob("*.yaml"))]
    return list(dict.fromkeys(t for t in targets if isinstance(t, str) and "." in t))


def task_module(task: str, config, only: bool):
    """The module that aggregates rows of `task`: among task_targets, the one named after it (the
    suite's repro.tasks.<task>); else, when they are the sweep's only rows, the sweep's own task
    (its composed config: a task whose rows carry another name). None: no task of this sweep."""
    modules = [t.rsplit(".", 1)[0] for t in task_targets(config)]
    named = [m for m in modules if m.rsplit(".", 1)[-1] == task]
    own = OmegaConf.select(config, "task._target_", default=None)
    name = named[0] if named else own.rsplit(".", 1)[0] if only and isinstance(own, str) and "." in own else None
    return importlib.import_module(name) if name else None


class AggregateSweep(Callback):
    def on_multirun_start(self, config, **kwargs):
        # run.py fixed hydra.sweep.dir before Hydra started (repro.cli.preflight.preflight): every job,
        # in whatever process or node a launcher runs it, writes under this one dir.
        sweep_dir = Path(config.hydra.sweep.dir)
        print(f"sweep dir: {sweep_dir.resolve()}", flush=True)
        from repro.cli import jobs  # an earlier sweep into this dir: its failures are not this sweep's

        for failed in sweep_dir.glob(f"*/{jobs.FAILED_FILE}"):
            failed.unlink(missing_ok=True)

    def on_job_start(self, config, **kwargs):
        from hydra.core.hydra_config import HydraConfig

        from repro.training.distributed import is_main

        if is_main() and HydraConfig.initialized():
            print(f"run dir: {HydraConfig.get().runtime.output_dir}", flush=True)

    def on_job_end(self, config, job_return=None, **kwargs):
        from hydra.core.hydra_config import HydraConfig

        from repro.training.distributed import is_main
        from repro.training.loggers import publish_dir

        if is_main() and HydraConfig.initialized():
            publish_dir(config, HydraConfig.get().runtime.output_dir)

    def on_multirun_end(self, config, **kwargs):
        from repro.cli import jobs

        sweep_dir = Path(config.hydra.sweep.dir)
        # Hydra turns an exception raised here into a warning and the sweep would exit 0: a summary
        # that fails is recorded instead, and run.py exits 1 naming it.
        try:
            self._aggregate(config, sweep_dir)
        except Exception as err:  # any failure of the summary fails the sweep, in one line
            jobs.summary_error = jobs.error_line(err) or f"{type(err).__name__}: {err}"
            print(f"\nerror: the sweep's summary in {sweep_dir} failed: {jobs.summary_error}", file=sys.stderr)
        jobs.failed_jobs[:] = jobs.sweep_failures(sweep_dir)
        if jobs.failed_jobs:
            n = len([d for d in sweep_dir.iterdir() if (d / ".hydra").is_dir()])
            print(f"\nerror: {len(jobs.failed_jobs)} of {n} jobs of the sweep failed:", file=sys.stderr)
            for job in jobs.failed_jobs:
                print(f"  #{job['job']} {' '.join(job['overrides'])}: {job['error']}", file=sys.stderr)

    @staticmethod
    def _aggregate(config, sweep_dir: Path):
        by_task = defaultdict(list)
        for path in sorted(sweep_dir.glob("*/results.jsonl"), key=lambda p: p.parent.name):
            for row in read_jsonl(path):
                by_task[row["task"]].append(row)
        for task, rows in by_task.items():
            write_jsonl(sweep_dir / f"{task}.jsonl", rows)
            module = task_module(task, config, only=len(by_task) == 1)
            if module is None:
                print(f"\n[{task}] {len(rows)} rows in {sweep_dir}: no task of this sweep writes them, not summarised")
            elif hasattr(module, "aggregate"):
                print(f"\n[{task}] {len(rows)} rows from {sweep_dir}")
                module.aggregate(rows, sweep_dir)
        if by_task:
            from repro.training.loggers import publish_dir

            publish_dir(config, sweep_dir, group=sweep_dir.name, job_type="sweep", name=f"{sweep_dir.name}-aggregate")
