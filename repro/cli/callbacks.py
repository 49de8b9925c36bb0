"""Hydra callbacks: at the end of a multirun, gather every job's results.jsonl into the
sweep directory and let the task aggregate them (one CSV, one plot, one table). With
logger=wandb, each job's and the sweep's CSVs and figures go to wandb as tables and images."""
import importlib
import sys
from collections import defaultdict
from pathlib import Path

from hydra.experimental.callback import Callback

from repro.common.results import read_jsonl, write_jsonl


def task_module(job_dir: Path):
    """The module of the task a sweep's job ran, from the job's own composed config
    (.hydra/config.yaml, task._target_): a task is found through its config, wherever it lives."""
    from omegaconf import OmegaConf

    config = job_dir / ".hydra" / "config.yaml"
    target = (OmegaConf.load(config).get("task") or {}).get("_target_") if config.is_file() else None
    return importlib.import_module(target.rsplit(".", 1)[0]) if target else None


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

        from repro.cli.logging import publish_dir
        from repro.training.distributed import is_main

        if is_main() and HydraConfig.initialized():
            publish_dir(config, HydraConfig.get().runtime.output_dir)

    def on_multirun_end(self, config, **kwargs):
        from repro.cli import jobs

        sweep_dir = Path(config.hydra.sweep.dir)
        # Hydra turns an exception raised here into a warning and the sweep would exit 0: a summary
        # that fails is recorded instead, and run.py exits 1 naming it.
        try:
            self._aggregate(config, sweep_dir)
        except Exception as err:  # noqa: BLE001 (any failure of the summary fails the sweep, in one line)
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
        by_task, modules = defaultdict(list), {}
        for path in sorted(sweep_dir.glob("*/results.jsonl"), key=lambda p: p.parent.name):
            for row in read_jsonl(path):
                by_task[row["task"]].append(row)
                if row["task"] not in modules:
                    modules[row["task"]] = task_module(path.parent)
        for task, rows in by_task.items():
            write_jsonl(sweep_dir / f"{task}.jsonl", rows)
            module = modules.get(task)
            if module is not None and hasattr(module, "aggregate"):
                print(f"\n[{task}] {len(rows)} rows from {sweep_dir}")
                module.aggregate(rows, sweep_dir)
        if by_task:
            from repro.cli.logging import publish_dir

            publish_dir(config, sweep_dir, group=sweep_dir.name, job_type="sweep", name=f"{sweep_dir.name}-aggregate")
