"""One check of a composed config, for every task, before any data is loaded or model built:
run.py calls validate(cfg) before a single run starts (repro.cli.preflight.preflight: no run dir is made
for a bad config) and at the start of each job of a sweep (a bad job is recorded, the sweep
goes on). A bad value is a ConfigError naming it and what is valid.

The tasks keep their own checks of their own settings; this covers what they share: the seed,
the model's sizes, and the attention layer, built once at the model's width (its constructor
checks its own settings, e.g. an LSH chunk_size or a Performer's n_features) and refused when
the task is autoregressive and the attention has no causal form.
"""
from hydra.utils import instantiate
from omegaconf import DictConfig

from repro.cli.attention import attention_name
from repro.cli.config import ConfigError, building_from_config

AUTOREGRESSIVE_TASKS = ("copy", "mnist", "cifar")  # causal models: every attention must have a causal form


# the model keys that count something (a dropout of 0, also an int, is not a size)
SIZE_KEYS = {"n_layers", "d_model", "n_heads", "d_ff", "d_keys", "d_values", "hidden", "subsample", "n_mixtures"}


def _sizes(cfg) -> DictConfig | None:
    """The model node holding the layer sizes (speech models: the node `encoder` names)."""
    m = cfg.get("model")
    if isinstance(m, DictConfig) and isinstance(m.get("encoder"), str) and isinstance(m.get(m.encoder), DictConfig):
        return m[m.encoder]
    return m if isinstance(m, DictConfig) else None


def validate(cfg):
    seed = cfg.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"seed={seed!r}: expected an integer, e.g. seed=0")
    sizes = _sizes(cfg)
    for key, value in (sizes.items() if sizes is not None else []):
        if key in SIZE_KEYS and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"model.{key}={value}: must be a positive integer")
    if cfg.get("attention") is None or sizes is None or "d_model" not in sizes or "n_heads" not in sizes:
        return
    name = attention_name(cfg)
    with building_from_config():  # the constructor's ValueError is the user's to fix
        layer = instantiate(cfg.attention)(d_model=sizes.d_model, n_heads=sizes.n_heads)
    task = cfg.task.get("name")
    causal = bool(cfg.task.get("causal", task in AUTOREGRESSIVE_TASKS))
    from repro.attention.noncausal import CAUSAL_CONFIGS, NonCausalAttention

    if causal and isinstance(layer, NonCausalAttention):
        why = "task.causal=true" if "causal" in cfg.task else f"task={task} is autoregressive"
        raise ConfigError(f"attention {name} is non-causal only and {why}; use a causal attention such as "
                          f"{CAUSAL_CONFIGS}" + (" (or task.causal=false)" if "causal" in cfg.task else ""))
