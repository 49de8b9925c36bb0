"""The suite's Hydra configs (conf/): where they are, composing a config group's entry by name
(the benchmark measures several attentions in one run), the run's directory and whether it is one
job of a sweep; `attention` says which attention a run's config names. Checks of plain config
values (device, dtype) live below, in repro.common.config."""
import os
import secrets
from functools import cache
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from repro.common.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@cache
def _uid():
    # pid + random: unique among jobs started in the same second, stable within a process.
    return f"{os.getpid()}{secrets.token_hex(2)}"


if not OmegaConf.has_resolver("uid"):
    OmegaConf.register_new_resolver("uid", _uid)


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def compose_group(group: str, name: str):
    """The config of conf/<group>/<name>.yaml as it composes inside the full config."""
    if name not in group_options(group):
        raise ConfigError(f"unknown {group} {name!r}; valid: {', '.join(group_options(group))}")
    overrides = [f"{group}={name}"]
    try:
        if GlobalHydra.instance().is_initialized():
            cfg = compose(config_name="config", overrides=overrides)
        else:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose(config_name="config", overrides=overrides)
    except MissingConfigException as err:
        raise ConfigError(str(err).splitlines()[0]) from err
    return cfg[group]


def run_dir(cfg) -> Path:
    """Where this run writes: Hydra's output dir under run.py, else cfg.run_dir or
    cfg.task.out_dir (tests and library use compose the config without Hydra's runtime)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("run_dir") or (cfg.get("task") or {}).get("out_dir") or ".")


def in_multirun() -> bool:
    """True inside one job of a Hydra sweep (-m), whose callback aggregates the whole sweep."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized() and HydraConfig.get().mode.name == "MULTIRUN"

