"""Host threads for the CPU paths of the causal product: groups of (batch, head) rows run on a
pool of Python threads with torch single-threaded in each (the chunked path's PyTorch pieces, the
fused CPU kernel and the linear layer's bounded-workspace passes all use it)."""
import os
from concurrent.futures import ThreadPoolExecutor

import torch


def may_use_threads() -> bool:
    """Host threads only in plain eager mode: torch.compile's tracing, dispatch and function
    modes (FakeTensorMode, FlopCounterMode, make_fx) are per thread, so work done on other
    threads would escape them (wrong traces, uncounted FLOPs)."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._len_torch_function_stack())


_POOLS = {}  # (pid, threads) -> executor; keyed by pid so a forked child never waits on its parent's threads


def run_groups(work, groups):
    """work(rows) for every group. With T > 1 threads the groups go to T Python threads that run
    torch single-threaded, instead of every op of every group forking T OpenMP threads: one
    forward + backward is ~25 ops, each a parallel region whose barrier waits for any thread the
    scheduler has parked, and on this shared 2-core machine that made 2 threads several times
    slower than 1. Measured at 2 threads (fwd + bwd, 9 interleaved rounds, load 3.3-3.5):
    1.56-2.05x (B 1, H 8, N 1024, D = M = 64), 1.33-1.73x (N 4096), 2.21-2.35x (B 64, N 256, D 32,
    M 33) faster. torch's thread count is process state: it reads 1 while the groups run and is
    restored after (grad mode is per thread, so the workers disable it themselves)."""
    if len(groups) == 1 or not may_use_threads() or (threads := torch.get_num_threads()) == 1:
        for rows in groups:
            work(rows)
        return
    key = (os.getpid(), threads)
    pool = _POOLS.get(key) or _POOLS.setdefault(key, ThreadPoolExecutor(threads, thread_name_prefix="causal_dot"))

    inference = torch.is_inference_mode_enabled()  # per thread too: the outputs may be inference tensors

    def run(rows):
        torch.set_num_threads(1)
        with torch.inference_mode(inference), torch.no_grad():  # this order: inference_mode(False) enables grad
            work(rows)

    torch.set_num_threads(1)
    try:
        list(pool.map(run, groups))
    finally:
        torch.set_num_threads(threads)
