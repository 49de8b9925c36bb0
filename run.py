"""Entry point: python run.py task=... attention=... [-m for sweeps]. See README.md."""
import re
import sys

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig

from repro.config import CONF_DIR, ConfigError, group_options
from repro.training import distributed


def check_group_choices(argv):
    """Fail fast, in one line, on `group=name` naming no file in conf/<group>/ (Hydra's own
    message for this lists its whole search path). Sweeps (a,b,c) are checked item by item."""
    for arg in argv:
        m = re.fullmatch(r"[+~]?([a-z_]+)=(.*)", arg)
        if not m or not (CONF_DIR / m[1]).is_dir() or "(" in m[2]:
            continue
        valid = group_options(m[1])
        for name in m[2].split(","):
            if name not in valid and name != "null":
                raise ConfigError(f"unknown {m[1]} {name!r}; valid: {', '.join(valid)}")


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    try:
        return hydra.utils.get_method(cfg.task._target_)(cfg)
    except (ConfigError, InstantiationException) as err:
        # A bad value in the config is the user's to fix: one line, no traceback.
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err
        print(f"error: {str(cause).strip().splitlines()[-1]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    try:
        check_group_choices(sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    distributed.share_run_dir(sys.argv)  # under torchrun: one run dir, chosen by rank 0, for all ranks
    try:
        main()
    finally:
        distributed.cleanup()
