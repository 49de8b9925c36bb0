"""The command line, checked before Hydra runs it (run.py calls `preflight`).

Hydra reports a bad command line in several lines (or not at all: a string where an integer
belongs goes through, and fails deep inside a task); here each problem is one ConfigError
naming the bad value and what is valid, raised before any run directory is made:

- `group=name` naming no file in conf/<group>/;
- `a.b=v` naming no key of the config (with the nearest key that exists);
- a value of the wrong type for its key (the preset's type: an integer stays an integer);
- for a single run, the composed config itself (repro.cli.validate).

It also fixes a sweep's directory: `hydra.sweep.dir` holds ${now:} and ${uid:}, which every
launcher worker (a joblib process, a submitit or SLURM job) would resolve again, each its own
dir. Resolved once here and passed on as an override, it is the same in every job.
"""
import difflib
import re

from omegaconf import DictConfig, ListConfig, OmegaConf

from repro.common.errors import ConfigError
from repro.conf import CONF_DIR, group_options

HYDRA_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc",
               "--version", "--resolve", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--experimental-rerun")
UNITS = ("_s", "_ms", "_mb", "_gb")  # a quantity in units is a number, even where its preset is an integer


def is_multirun(argv) -> bool:
    return any(a in ("-m", "--multirun") or a.replace(" ", "") == "hydra.mode=MULTIRUN" for a in argv)


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


def _is_group(key: str) -> bool:
    return "/" in key or "@" in key or (CONF_DIR / key).is_dir()


def _values(override) -> list:
    """The values an override sets: one, or each of a sweep's (interval sweeps: none)."""
    if not override.is_sweep_override():
        return [override.value()]
    return list(override.sweep_iterator()) if override.is_discrete_sweep() else []


def _keys(node, prefix="") -> list[str]:
    out = []
    for k in node.keys() if isinstance(node, DictConfig) else []:
        path = f"{prefix}{k}"
        out.append(path)
        child = node._get_node(k)
        if isinstance(child, DictConfig):
            out += _keys(child, path + ".")
    return out


def _has_key(cfg, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if isinstance(node, ListConfig) and part.isdigit() and int(part) < len(node):
            node = node._get_node(int(part))  # a list item: trainer.scheduler.milestones.0=100
        elif isinstance(node, DictConfig) and part in node.keys():  # noqa: SIM118 (`in` on a DictConfig skips keys like _target_)
            node = node._get_node(part)
        else:
            return False
    return True


def nearest_key(cfg, key: str) -> str | None:
    """The config key closest to `key`: one ending in the same name (trainer.lr ->
    trainer.optimizer.lr) first, else the closest spelling (difflib)."""
    keys = [k for k in _keys(cfg) if not k.startswith("hydra")]
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    close = difflib.get_close_matches(key, same_leaf or keys, n=1, cutoff=0 if same_leaf else 0.6)
    return close[0] if close else None


def _type_error(key, value, preset) -> str | None:
    """Why `value` cannot replace `preset` (None: it can). null is always accepted (several
    settings take it: the task says where it does not)."""
    if value is None or preset is None or isinstance(preset, (DictConfig, list)) or OmegaConf.is_config(preset):
        return None
    if isinstance(preset, bool):
        return None if isinstance(value, bool) else "expected true or false"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(preset, int) and not key.endswith(UNITS):
        return None if number and isinstance(value, int) else f"expected an integer (preset: {preset})"
    if isinstance(preset, (int, float)):
        return None if number else f"expected a number (preset: {preset})"
    return None


def _load(loader, overrides, multirun: bool):
    from hydra.types import RunMode

    return loader.load_configuration(config_name="config", overrides=overrides,
                                     run_mode=RunMode.MULTIRUN if multirun else RunMode.RUN)


def _quote(value: str) -> str:
    return "'" + value.replace("'", "\\'") + "'"


def preflight(argv: list[str], pin_sweep_dir: bool = True) -> list[str]:
    """Check the command line (argv without the program) and, for a single run, the config it
    composes (a sweep's jobs are validated as each starts); returns it, with the sweep dir
    fixed for a multirun. Raises ConfigError."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.utils import setup_globals
    from hydra.errors import HydraException
    from hydra.types import RunMode

    check_group_choices(argv)
    if any(a.split("=", 1)[0] in HYDRA_FLAGS for a in argv):
        return argv  # printing help or the config: Hydra's business
    multirun = is_multirun(argv)
    args = [a for a in argv if not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except HydraException:
        return argv  # a syntax error: Hydra's own message names it
    setup_globals()  # Hydra's ${now:} and ${hydra:} resolvers
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        # The preset: the config the chosen groups give, before any value is set (a group
        # sweep: its first choice).
        groups = [o for o in overrides if _is_group(o.key_or_group) or o.is_delete()]
        try:
            preset = _load(loader, [f"{o.get_key_element()}={_values(o)[0]}" if o.is_sweep_override()
                                    else o.input_line for o in groups], multirun=False)
        except HydraException:  # Hydra's own message says what is wrong (or a glob() sweep it expands itself)
            return _pinned(argv, loader, overrides) if multirun and pin_sweep_dir else argv
        for o in overrides:
            key = o.key_or_group
            if any(o is g for g in groups) or o.is_hydra_override() or o.is_add():
                continue
            if not _has_key(preset, key):
                if o.is_force_add():
                    continue
                near = nearest_key(preset, key)
                raise ConfigError(f"{key} is not a setting of this config" + (f"; nearest: {near}" if near else "")
                                  + f" (to add a new key: +{o.input_line.lstrip('+')})")
            try:
                was = OmegaConf.select(preset, key)
            except Exception:  # an interpolation only Hydra's runtime resolves: no type to check
                was = None
            for value in _values(o):
                if isinstance(value, str) and "${" in value:
                    continue  # an interpolation: its type is known once resolved
                why = _type_error(key, value, was)
                if why:
                    raise ConfigError(f"{key}={value!r}: {why}")
        try:
            cfg = _load(loader, args, multirun)
        except HydraException:
            return _pinned(argv, loader, overrides) if multirun and pin_sweep_dir else argv
    multirun = multirun or cfg.hydra.mode == RunMode.MULTIRUN
    if not multirun:
        from repro.cli.validate import validate

        validate(cfg)
        return argv
    return _pin(argv, cfg) if pin_sweep_dir else argv


def _pin(argv, cfg):
    """argv with hydra.sweep.dir fixed: resolving ${now:} and ${uid:} here, once, is what puts
    every job of a launcher's sweep (other processes, other nodes) under one dir."""
    sweep_dir = str(cfg.hydra.sweep.dir)
    return [a for a in argv if not a.startswith("hydra.sweep.dir=")] + [f"hydra.sweep.dir={_quote(sweep_dir)}"]


def _pinned(argv, loader, overrides):
    """_pin when the whole command line does not compose here (a glob() sweep, which only
    Hydra's sweeper expands): the sweep dir from the overrides that are not sweeps."""
    from hydra.errors import HydraException

    try:
        return _pin(argv, _load(loader, [o.input_line for o in overrides if not o.is_sweep_override()], False))
    except HydraException:
        return argv
