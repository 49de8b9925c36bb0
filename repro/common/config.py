"""Config values read and checked for every floor, without Hydra: a device, a dtype, a task's
list of settings. A bad value is a ConfigError naming it and what is valid."""
import torch

from repro.common.errors import ConfigError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
