"""Helpers around Hydra: user-facing config errors, the run-dir resolver, and composing a
config group's entry by name (the benchmark measures several attentions in one run)."""
import os
import secrets
from functools import lru_cache
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from repro.common.errors import ConfigError, RunFailed, building_from_config  # noqa: F401 (the CLI floor's names)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@lru_cache(maxsize=None)
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


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but no CUDA GPU is visible; use device=cpu or device=auto")
    return device


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


def nonempty(t, key: str, example: str) -> list:
    """task.<key> as a list, refused in one line when missing or empty."""
    value = t.get(key)
    if value is None or len(value) == 0:
        raise ConfigError(f"task.{key} is empty; give at least one, e.g. task.{key}={example}")
    return list(value)


def positive_ints(t, key: str, example: str) -> list[int]:
    """task.<key>, a non-empty list of positive integers (lengths, batch sizes), else one line."""
    value = nonempty(t, key, example)
    if bad := [x for x in value if not isinstance(x, int) or isinstance(x, bool) or x < 1]:
        raise ConfigError(f"task.{key}: {bad} not positive integers; e.g. task.{key}={example}")
    return value
