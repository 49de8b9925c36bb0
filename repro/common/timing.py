"""Timing for every benchmark of the suite, in one place: a clock around a block of calls, warm-up,
repeats and their median, interleaved rounds, and the passes of the causal product's methods
(task=kernels, python -m repro.reproduction.bench and python -m repro.reproduction.cpu_speed time
them through time_product).

Clocks. time_calls reads the wall clock (time.perf_counter) and this process's CPU time (all its
threads: time.process_time) around `calls` back-to-back calls and gives both per call. On a CUDA
device the device is synchronised before and after, so the queued work counts; with events=True
the time is instead the device's between two CUDA events recorded around the block on the current
stream (nothing synchronised before the start event, the device after the end one). Elsewhere
events=True is the wall clock.
"""
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

PASSES = {"fwd": False, "fwd_bwd": True}  # a pass's name -> whether it runs the backward


def _cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def sync(device=None) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if _cuda(device):
        torch.cuda.synchronize(device)


class Span(NamedTuple):
    seconds: float  # per call: the wall clock, or the device's time between CUDA events
    cpu_seconds: float  # per call: this process's CPU time, every thread's


def time_calls(fn: Callable, device=None, calls: int = 1, events: bool = False) -> Span:
    """`calls` calls of fn timed as one block, per call (the module's docstring: which clock)."""
    if events and _cuda(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cpu0 = time.process_time()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return Span(start.elapsed_time(end) / 1e3 / calls, (time.process_time() - cpu0) / calls)
    sync(device)
    cpu0 = time.process_time()
    t0 = time.perf_counter()  # the CPU clock's reads stay outside the wall clock's span
    for _ in range(calls):
        fn()
    sync(device)
    t1 = time.perf_counter()
    return Span((t1 - t0) / calls, (time.process_time() - cpu0) / calls)


def warm_up(fn: Callable, calls: int) -> None:
    """Untimed calls (compiles, caches, lazy imports, thread pools), nothing synchronised."""
    for _ in range(calls):
        fn()


class Timings(NamedTuple):
    median: float  # seconds per call, the median of the timed blocks
    times: list  # seconds per call of every timed block, in order

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)


def repeat(fn: Callable, repeats: int, device=None, warmup: int = 0, calls: int = 1, events: bool = False) -> Timings:
    """`warmup` untimed calls, then `repeats` timed blocks of `calls` calls each (time_calls)."""
    warm_up(fn, warmup)
    times = [time_calls(fn, device, calls, events).seconds for _ in range(repeats)]
    return Timings(statistics.median(times), times)


def interleaved(fns: dict, rounds: int, warmup: int = 1, settle: int = 0, device=None,
                events: bool = False) -> dict:
    """name -> Timings of one call a round: `warmup` untimed calls of each fn (all of the first
    one's, then the next one's), then every round runs each fn once, in the dict's order (A, B,
    A, B, ...), so a load change on a shared machine hits every method alike. Each timed call
    follows `settle` untimed calls of the same fn: at T > 1 threads the OpenMP threads of the
    previous method's parallel regions keep spinning for a while after it returns, and on 2 cores
    they take them from the next method's first moments (measured: the causal product's fwd + bwd
    at N = 1,024 7.3 ms alone, 11.6 ms right after the authors' kernel)."""
    for fn in fns.values():
        warm_up(fn, warmup)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            warm_up(fn, settle)
            times[name].append(time_calls(fn, device, events=events).seconds)
    return {name: Timings(statistics.median(ts), ts) for name, ts in times.items()}


class Stopwatch:
    """Wall-clock and CPU seconds since it was made, read as often as wanted (a generation's
    per-step stamps); the device is synchronised when it starts and before every wall reading."""

    def __init__(self, device=None):
        self.device = device
        sync(device)
        self.cpu0 = time.process_time()
        self.t0 = time.perf_counter()

    def wall(self) -> float:
        sync(self.device)
        return time.perf_counter() - self.t0

    def cpu(self) -> float:
        return time.process_time() - self.cpu0


def one_call(fn: Callable, xs, grad, backward: bool) -> Callable:
    """One call of a pass on xs: fn's forward without autograd, or forward + backward (the
    gradients of the inputs that require them, against grad)."""
    wrt = [x for x in xs if x.requires_grad]
    if backward:
        def run():
            torch.autograd.grad(fn(*xs), wrt, grad)
    else:
        def run():
            with torch.no_grad():
                fn(*xs)
    return run


def time_product(ops: dict, inputs: Callable, passes, timer: Callable) -> dict:
    """The causal product's methods (ops of its kind, (q, k, v[, extra]) -> out) timed at one size:
    pass -> timer's answer for that pass. inputs(name, backward) -> (xs, grad) gives each method
    its inputs (its layout, its extra input), made once per method and pass; timer({name: call})
    -> {name: result} times one pass's calls, one after another (repeat per call) or interleaved."""
    out = {}
    for pass_ in passes:
        backward = PASSES[pass_]
        out[pass_] = timer({name: one_call(fn, *inputs(name, backward), backward) for name, fn in ops.items()})
    return out
