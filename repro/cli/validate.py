"""One check of a composed config, for every task, before any data is loaded or model built:
run.py calls validate(cfg) before a single run starts (repro.cli.preflight.preflight: no run dir is made
for a bad config) and at the start of each job of a sweep (a bad job is recorded, the sweep
goes on). A bad value is a ConfigError naming it and what is valid.

The tasks keep their own checks of their own settings; this covers what they share: the seed,
every number finite and every dropout a probability, the trainer's settings (also checked by
fit()), the model's sizes, and the attention layer, built once at the model's width (its constructor
checks its own settings, e.g. an LSH chunk_size or a Performer's n_features) and refused when
the task is autoregressive and the attention has no causal form, or the task is non-causal
(task=asr, task.causal=false) and the attention has no non-causal form. A user's class needs only
the call (an nn.Module whose forward takes x, causal and key_padding_mask): what it does not say
(causal_only, recurrent, step) it is taken not to have.
"""
import math

from omegaconf import DictConfig

from repro.common.errors import ConfigError
from repro.conf.attention import attention_name, build_attention

AUTOREGRESSIVE_TASKS = ("copy", "mnist", "cifar")  # causal models: every attention must have a causal form
NON_CAUSAL_TASKS = ("asr",)  # non-causal encoders: every attention must have a non-causal form


# the model keys that count something (a dropout of 0, also an int, is not a size)
SIZE_KEYS = {"n_layers", "d_model", "n_heads", "d_ff", "d_keys", "d_values", "hidden", "subsample", "n_mixtures"}


def _sizes(cfg) -> DictConfig | None:
    """The model node holding the layer sizes (speech models: the node `encoder` names)."""
    m = cfg.get("model")
    if isinstance(m, DictConfig) and isinstance(m.get("encoder"), str) and isinstance(m.get(m.encoder), DictConfig):
        return m[m.encoder]
    return m if isinstance(m, DictConfig) else None


# Keys that hold a probability (a dropout): in [0, 1), wherever they are
PROBABILITY_KEYS = {"dropout", "embedding_dropout", "attention_dropout"}
# Keys that count or measure something that must exist (a size, a batch, a length, a number of
# repeats, a time budget, a stabiliser): positive, wherever they are (also a per-dataset dict of
# them, task.methods.lsh-4.settings.chunk_size.mnist). Zero means "off" for none of them.
POSITIVE_KEYS = {"batch_size", "batch", "n_mixtures", "repeats", "tokens", "probes", "n_symbols", "max_len",
                 "heads", "d", "m", "n_layers", "chunk_size", "initial_cache", "time_budget_s", "eps", "gamma",
                 "factor", "n_features", "n_rounds", "n_buckets", "bucket_size", "window", "n_landmarks",
                 "n_mels", "eval_batch_size", "renditions", "n_sentences", "min_words", "max_words", "hidden",
                 "subsample", "batch_size_by_attention", "resize", "max_train", "milestones"}
# Keys where 0 means none or off, and a negative value nothing: >= 0
NON_NEGATIVE_KEYS = {"warmup", "n_samples", "patience", "freq_mask", "time_mask", "n_masks", "eval_every",
                     "checkpoint_every", "seed", "eval_seed", "beam_size"}  # numpy: no negative seed
FRACTION_KEYS = {"valid_fraction", "test_fraction"}  # a share of the data: in (0, 1)


def _numbers(node, prefix):
    """(dotted key, value) of every number under node (lists and dicts walked)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        key = f"{prefix}.{k}"
        if isinstance(v, (dict, list)):
            yield from _numbers(v, key)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield key, v


def _check_numbers(cfg, groups):
    """Every number of the run's settings finite; every dropout a probability; every size,
    count and budget positive (POSITIVE_KEYS), every switch-off-able count >= 0."""
    from omegaconf import OmegaConf

    for group in groups:
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        for key, value in _numbers(OmegaConf.to_container(node, resolve=True), group):
            if not math.isfinite(value):
                raise ConfigError(f"{key}={value}: must be a finite number")
            parts = set(key.split(".")[1:])
            if key.rsplit(".", 1)[-1] in PROBABILITY_KEYS and not 0 <= value < 1:
                raise ConfigError(f"{key}={value}: a dropout probability, in [0, 1)")
            if parts & POSITIVE_KEYS and value <= 0:
                raise ConfigError(f"{key}={value}: must be positive")
            if parts & NON_NEGATIVE_KEYS and value < 0:
                raise ConfigError(f"{key}={value}: must be 0 (off or none) or more")
            if parts & FRACTION_KEYS and not 0 < value < 1:
                raise ConfigError(f"{key}={value}: a share of the data, in (0, 1)")


def validate(cfg):
    seed = cfg.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed={seed!r}: expected a non-negative integer, e.g. seed=0")
    _check_numbers(cfg, ("task", "trainer", "model"))
    if isinstance(cfg.get("trainer"), DictConfig):  # the trainer's own checks, before any data is loaded
        from repro.training.parts import validate as validate_trainer

        validate_trainer(cfg.trainer)
    sizes = _sizes(cfg)
    for key, value in (sizes.items() if sizes is not None else []):
        if key in SIZE_KEYS and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"model.{key}={value}: must be a positive integer")
    if cfg.get("attention") is None or sizes is None or "d_model" not in sizes or "n_heads" not in sizes:
        _check_numbers(cfg, ("attention",))
        return
    name = attention_name(cfg)
    layer = build_attention(cfg, sizes.d_model, sizes.n_heads)
    _check_numbers(cfg, ("attention",))  # after the constructor, whose own lines say more
    task = cfg.task.get("name")
    if task != "conformance":  # which checks the call itself, and says so in its table
        from repro.attention.contract import contract_gap

        gap = contract_gap(layer)
        if gap:
            raise ConfigError(f"attention._target_={cfg.attention._target_}: {gap} (python run.py task=conformance "
                              f"... checks a class against the whole contract)")
    causal = bool(cfg.task.get("causal", task in AUTOREGRESSIVE_TASKS))
    from repro.attention.noncausal import CAUSAL_CONFIGS, NonCausalAttention

    if causal and isinstance(layer, NonCausalAttention):
        why = "task.causal=true" if "causal" in cfg.task else f"task={task} is autoregressive"
        raise ConfigError(f"attention {name} is non-causal only and {why}; use a causal attention such as "
                          f"{CAUSAL_CONFIGS}" + (" (or task.causal=false)" if "causal" in cfg.task else ""))
    # only where the task runs the non-causal form (task=conformance checks whichever forms exist)
    # a user's plain nn.Module need not say: without the attribute it is taken to have both forms
    if getattr(layer, "causal_only", False) and (task in NON_CAUSAL_TASKS or cfg.task.get("causal", True) is False):
        from repro.attention.successors import BIDIRECTIONAL_CONFIGS, ENABLE_BIDIRECTIONAL

        why = "task.causal=false" if "causal" in cfg.task else f"task={task} is non-causal"
        # gla and delta: run both directions (a layer attribute, so a user's class may offer it too)
        both = f", or {ENABLE_BIDIRECTIONAL}" if hasattr(layer, "bidirectional") else ""
        also = " (or task.causal=true)" if "causal" in cfg.task else ""
        raise ConfigError(f"attention {name} is causal only and {why}; use an attention with a non-causal form "
                          f"such as {BIDIRECTIONAL_CONFIGS}{both}{also}")
