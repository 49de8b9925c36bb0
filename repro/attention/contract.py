"""The attention contract as the suite calls it. What the model needs of a layer is the call,
`layer(x, causal=..., key_padding_mask=...) -> (B, N, d_model)` on an nn.Module; the rest of an
AttentionLayer's surface (`causal_only`, `recurrent`, `step`) is optional for any other class,
which is taken not to have what it does not say (repro.attention.base.is_recurrent).

Calls made to check a layer (repro.attention.conformance) run under one fixed seed (torch's,
numpy's and Python's generators), so a layer that draws random numbers draws the same ones in
every call; a SystemExit or any other BaseException but KeyboardInterrupt that the layer raises
comes out as an Exception (Escaped), to fail the check it was raised in rather than end the run,
unless a signal handler raised it (run.py's SIGINT/SIGTERM: the user stopping the run).
"""
import contextlib
import inspect
import random
import signal

import numpy as np
import torch
from torch import nn

from repro.attention.base import AttentionLayer

DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


class Escaped(Exception):
    """A BaseException other than KeyboardInterrupt (SystemExit, GeneratorExit, ...) raised by the
    attention, carried as an Exception: it fails the check it was raised in, not the whole run."""


def stopped_by_signal(err: BaseException) -> bool:
    """Was it raised by a Python signal handler (run.py's SIGINT/SIGTERM raise SystemExit to stop
    the run)? Then it is the user stopping the run, not the attention failing."""
    handlers = {getattr(signal.getsignal(s), "__code__", None) for s in (signal.SIGINT, signal.SIGTERM)} - {None}
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return False


def contract_gap(layer) -> str | None:
    """Why the model cannot call this layer as it calls every attention, forward(x, causal=...,
    key_padding_mask=...), or None. Only the call is read: the other attributes of an
    AttentionLayer (causal_only, recurrent, step) are optional for any other nn.Module."""
    if not isinstance(layer, nn.Module):
        return f"built a {type(layer).__name__}, not a torch.nn.Module"
    if isinstance(layer, AttentionLayer):
        return None
    try:
        params = inspect.signature(layer.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature (a C extension): let the call tell
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    missing = [p for p in ("causal", "key_padding_mask") if p not in params]
    if missing:
        return (f"{type(layer).__name__}.forward takes no {', '.join(missing)}: "
                f"forward(x, causal=..., key_padding_mask=...) is the call")
    return None


def zero_dropout(layer) -> list[str]:
    """Sets every dropout of the layer to 0 in place: torch's Dropout modules, and float attributes
    named like a dropout (attention_dropout, nn.MultiheadAttention's dropout). Returns the names
    of those that were not 0."""
    names = []
    for prefix, m in layer.named_modules():
        if isinstance(m, DROPOUTS):
            if m.p:
                names.append(prefix or type(m).__name__)
            m.p = 0.0
            continue
        for key, value in list(vars(m).items()):
            if "dropout" in key.lower() and isinstance(value, float):  # a float: not a flag, not a module
                if value:
                    names.append(f"{prefix}.{key}" if prefix else key)
                setattr(m, key, 0.0)
    return names


@contextlib.contextmanager
def seeded(seed: int, device: torch.device):
    """torch's, numpy's and Python's generators seeded inside, restored after."""
    cuda = [device] if device.type == "cuda" else []
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def rng_states(device: torch.device):
    """The generators' states, to tell whether a call drew from them."""
    cuda = [torch.cuda.get_rng_state(device)] if device.type == "cuda" else []
    npy = np.random.get_state()
    return [torch.random.get_rng_state(), *cuda], (npy[1].tobytes(), npy[2]), random.getstate()


def drew(before, after) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before[0], after[0])) or before[1:] != after[1:]


def call(fn, seed: int, device: torch.device):
    """fn() under the fixed seed: the layer's random draws, if any, are the same every call. A
    SystemExit or other BaseException from the attention comes out as Escaped."""
    with seeded(seed, device):
        try:
            return fn()
        except (Exception, KeyboardInterrupt):
            raise
        except BaseException as err:  # user code must not end the check, nor the run
            if stopped_by_signal(err):
                raise
            raise Escaped(repr(err)) from err


def describe(err) -> str:
    """What was raised, in one line: its type and the last line of its message."""
    if isinstance(err, Escaped):
        return str(err)
    line = (str(err).strip().splitlines() or [""])[-1]
    return f"{type(err).__name__}: {line}" if line else type(err).__name__
