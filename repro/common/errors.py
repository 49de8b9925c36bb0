"""The errors every floor raises for the user: a bad setting (ConfigError, one line and exit 2
under run.py) or a run that produced nothing (RunFailed, exit 1). No Hydra here: the library
raises them too."""
from contextlib import contextmanager


class ConfigError(ValueError):
    """A bad value in the user's config: run.py prints it as one line, without a traceback."""


class RunFailed(RuntimeError):
    """A run that went through but produced no result (every point of a benchmark failed):
    its rows are written; run.py prints this as one line and exits 1."""


@contextmanager
def building_from_config():
    """Wrap the building of modules from the config: a ValueError raised there (a constructor
    rejecting a setting) is the user's to fix, so it becomes a ConfigError."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from err
