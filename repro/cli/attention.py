"""Which attention a run uses, and which of its settings the user chose: the one place every
task, the benchmark and the config checks ask (conf/attention is the registry; its entry's name
is what rows, tables and the report call the attention)."""
from omegaconf import OmegaConf

from repro.cli.config import ConfigError, compose_group, group_options


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


def attention_config(name: str) -> dict:
    """conf/attention/<name>.yaml as it composes, a plain dict (ConfigError for an unknown name)."""
    return OmegaConf.to_container(compose_group("attention", name))
