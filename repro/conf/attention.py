"""Which attention a run uses, and which of its settings the user chose: the one place every
task, the benchmark and the config checks ask (conf/attention is the registry; its entry's name
is what rows, tables and the report call the attention)."""
from omegaconf import OmegaConf

from repro.common.errors import ConfigError
from repro.conf import compose_group, group_options


def attention_name(cfg) -> str:
    """The conf/attention entry this run uses: Hydra's choice under run.py (or in the config's own
    hydra node); composed without Hydra's runtime (tests, notebooks), the entry the attention node
    equals, or the closest entry of its class; else its class name."""
    if cfg.get("attention") is None:
        raise ConfigError(f"task={cfg.task.name} needs an attention: attention=<one of conf/attention>")
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        name = HydraConfig.get().runtime.choices.get("attention")
        if name:
            return name
    name = OmegaConf.select(cfg, "hydra.runtime.choices.attention")  # composed with its hydra node
    if name:
        return name
    mine = OmegaConf.to_container(cfg.attention, resolve=True)
    entries = {name: OmegaConf.to_container(compose_group("attention", name), resolve=True)
               for name in group_options("attention")}
    # the entry it equals; else the closest entry of the same class (a setting the user changed)
    same_class = {name: sum(e.get(k) != mine.get(k) for k in set(e) | set(mine))
                  for name, e in entries.items() if e.get("_target_") == mine.get("_target_")}
    if same_class:
        return min(same_class, key=lambda name: (same_class[name], name))
    return cfg.attention._target_.rsplit(".", 1)[-1]


def user_set(cfg, name) -> set[str]:
    """The attention keys the user chose: named on the command line (Hydra's record of the
    overrides), or, composed without Hydra's runtime, differing from conf/attention/<name>.yaml."""
    from hydra.core.hydra_config import HydraConfig

    keys = set()
    if HydraConfig.initialized():
        for override in HydraConfig.get().overrides.task:
            key = override.split("=", 1)[0].lstrip("+~")
            if key.startswith("attention."):
                keys.add(key.split(".")[1])
    own = compose_group("attention", name)
    return keys | {k for k in cfg.attention if k not in own or cfg.attention[k] != own[k]}


def named_attentions() -> list[str]:
    """The conf/attention entries that name their class: every one but `custom`, whose class the
    user gives (attention._target_=...). What the tests check one by one."""
    return [name for name in group_options("attention")
            if not OmegaConf.is_missing(compose_group("attention", name), "_target_")]


def attention_config(name: str) -> dict:
    """conf/attention/<name>.yaml as it composes, a plain dict (ConfigError for an unknown name)."""
    return OmegaConf.to_container(compose_group("attention", name))


CUSTOM_HINT = "the folder holding its package must be on the Python path: PYTHONPATH=<that folder> python run.py ..."


def attention_factory(cfg):
    """instantiate(cfg.attention): the partial the model calls with d_model and n_heads. What the
    user must fix is one line: attention=custom without its class, or a class that cannot be
    imported (a user's package off the Python path, a misspelt name)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    node = cfg.attention
    if OmegaConf.is_missing(node, "_target_"):
        raise ConfigError("attention=custom needs your class: attention._target_=package.module.Class "
                          f"({CUSTOM_HINT})")
    try:
        return instantiate(node)
    except InstantiationException as err:
        if not isinstance(err.__cause__, ImportError):
            raise
        lines = str(err.__cause__).strip().splitlines()
        why = lines[1] if len(lines) > 2 else lines[-1]  # Hydra's: Error loading ..., the import's own error, a hint
        raise ConfigError(f"attention._target_={node._target_}: cannot be imported ({why}); {CUSTOM_HINT}") from err


def build_attention(cfg, d_model: int, n_heads: int):
    """The attention layer as the model builds it, Class(d_model=..., n_heads=...), a constructor
    that rejects a setting or these arguments (a user's class) failing in one line."""
    from repro.common.errors import building_from_config

    factory = attention_factory(cfg)
    with building_from_config():  # the constructor's ValueError is the user's to fix
        try:
            return factory(d_model=d_model, n_heads=n_heads)
        except TypeError as err:  # a signature that does not take what the model passes
            if "argument" not in str(err):
                raise
            raise ConfigError(f"attention._target_={cfg.attention._target_}: cannot be built as the model builds "
                              f"every attention, Class(d_model={d_model}, n_heads={n_heads}, <its settings>): "
                              f"{err}") from err
        except SystemExit as err:  # from a user's constructor: not a run that ended well
            from repro.attention.contract import stopped_by_signal

            if stopped_by_signal(err):
                raise
            raise ConfigError(f"attention._target_={cfg.attention._target_}: Class(d_model={d_model}, "
                              f"n_heads={n_heads}) raised {err!r}") from err
