"""Entry point: python run.py task=... attention=... [-m for sweeps]. See README.md."""
import os
import signal
import sys

_stopped_by: list[int] = []  # the signal _stop_at_once acted on


def _stop_at_once(signum, _frame):
    """SIGINT/SIGTERM outside the training loop (start-up, data loading, a benchmark, the summaries:
    the loop's own handlers checkpoint first): one line and the shell's status, no traceback. Set
    for SIGINT too when the process started with it ignored (a background job): it was sent on
    purpose (repro.training.stopping does the same inside the loop). The SystemExit lands in whatever
    code runs, and some (OmegaConf's flag_override) fail in their `finally` on what it left half-built:
    that error is the stop's, and `main` and the end of this file exit as the stop, quietly."""
    if _stopped_by:  # a second signal while unwinding from the first
        raise SystemExit(128 + _stopped_by[0])
    _stopped_by.append(signum)
    name = signal.Signals(signum).name
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()  # the line below on a line of its own, and last
    print(f"error: stopped by {name} outside the training loop (no checkpoint written at this point)",
          file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


for _s in (signal.SIGINT, signal.SIGTERM):  # first, before the imports: they take seconds
    signal.signal(_s, _stop_at_once)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from repro.cli import jobs, rundir  # noqa: E402
from repro.cli.joblog import tee_to_job_log  # noqa: E402
from repro.cli.preflight import HYDRA_FLAGS, is_multirun, preflight  # noqa: E402
from repro.cli.validate import validate  # noqa: E402
from repro.common.errors import ConfigError  # noqa: E402
from repro.conf import in_multirun  # noqa: E402
from repro.kernels.plumbing.backend import forced_backend  # noqa: E402
from repro.training import distributed  # noqa: E402


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    with tee_to_job_log():  # what the job prints goes to <run dir>/run.log too
        jobs.job_started()
        try:
            if in_multirun():  # a single run's config was validated before Hydra started (preflight)
                validate(cfg)
            result = hydra.utils.get_method(cfg.task._target_)(cfg)
            jobs.fail_if_diverged()  # a non-finite loss: the task wrote its summaries; the job fails
            return result
        except Exception as err:  # jobs.job_failed re-raises what is not the user's to fix
            if _stopped_by:  # broken by the stop's SystemExit (see _stop_at_once): the stop's line is out
                raise SystemExit(128 + _stopped_by[0]) from None
            return jobs.job_failed(err)


if __name__ == "__main__":
    from repro.common.results import COMMAND_ENV, run_command

    # the command as typed (preflight adds the pinned sweep dir), carried by every row and so into the
    # command.txt of a published folder; in the environment, so a launcher's worker processes see it
    os.environ[COMMAND_ENV] = run_command(sys.argv[1:], distributed.env_world_size())
    try:
        forced_backend()  # a bad REPRO_KERNEL now, not from a benchmark's every point or a first forward
        # Under torchrun rank 0 fixes the run dir for all ranks (below); each rank must not pick its own.
        single_process = distributed.env_world_size() <= 1
        sys.argv[1:] = preflight(sys.argv[1:], pin_sweep_dir=single_process)
        runs = not any(a.split("=", 1)[0] in HYDRA_FLAGS for a in sys.argv[1:])  # not --help, --cfg job, ...
        if single_process and runs:  # a named run dir or the pinned sweep dir: one run at a time, before Hydra writes
            rundir.hold(sys.argv[1:], multirun=is_multirun(sys.argv[1:]))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    distributed.share_run_dir(sys.argv)  # under torchrun: one run dir, chosen by rank 0, for all ranks
    if not single_process and runs:  # ... and rank 0 holds its lock for all of them
        refused = None
        if distributed.is_main():
            try:
                rundir.hold(sys.argv[1:], multirun=is_multirun(sys.argv[1:]))
            except ConfigError as err:
                refused = str(err)
        refused = distributed.broadcast_object(refused)
        if refused:
            if distributed.is_main():
                print(f"error: {refused}", file=sys.stderr)
            distributed.cleanup()
            sys.exit(2)
    try:
        main()
    except BaseException:
        if not _stopped_by:
            raise
        sys.exit(128 + _stopped_by[0])  # whatever Hydra made of the stop, it exits as the stop
    finally:
        distributed.cleanup()
    if jobs.failed_jobs or jobs.summary_error:  # a sweep that went on past failed jobs (listed at its end), or
        # whose summary failed, still fails
        sys.exit(1)
