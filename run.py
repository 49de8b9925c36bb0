"""Entry point: python run.py task=... attention=... [-m for sweeps]. See README.md."""
import sys

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig

from repro.cli import preflight
from repro.config import ConfigError, RunFailed, in_multirun
from repro.training import distributed
from repro.validate import validate


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    try:
        if in_multirun():  # a single run's config was validated before Hydra started (preflight)
            validate(cfg)
        return hydra.utils.get_method(cfg.task._target_)(cfg)
    except (ConfigError, InstantiationException) as err:
        # A bad value in the config is the user's to fix: one line, no traceback.
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err
        print(f"error: {str(cause).strip().splitlines()[-1]}", file=sys.stderr)
        sys.exit(2)
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    try:
        # Under torchrun rank 0 fixes the run dir for all ranks (below); each rank must not pick its own.
        sys.argv[1:], _ = preflight(sys.argv[1:], pin_sweep_dir=distributed.env_world_size() <= 1)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    distributed.share_run_dir(sys.argv)  # under torchrun: one run dir, chosen by rank 0, for all ranks
    try:
        main()
    finally:
        distributed.cleanup()
