"""What a forward pass keeps for its backward pass, counted exactly: every tensor autograd saves
passes through a saved_tensors_hooks pack hook, and the distinct storages behind them are summed
(a view of a kept tensor costs nothing more; a parameter counts once, as it would on a device).
This is exact for a given backend and input, where peak resident memory is noisy and includes
the allocator's slack; both are recorded by the benchmark (task=benchmark).

Below, the memory limit of the timing tasks (benchmark, throughput, kernels): one rule for the
limit, one test of whether an error is running out of memory, and a cap on this process's memory
for the points that run in it, so that a point too large becomes an 'oom' row instead of a process
killed by the operating system."""
import contextlib
import resource
import sys

import psutil
import torch

# The allocator's words for running out (torch's CPU allocator, CUDA, glibc)
OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "DefaultCPUAllocator")


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return (t.device, storage.data_ptr()), storage.nbytes()


def saved_bytes(fn, *args, **kwargs) -> tuple[int, object]:
    """(bytes of the distinct storages autograd keeps for backward while `fn(*args, **kwargs)`
    runs, its result). Tensors without storage (sparse, meta) count 0."""
    seen = {}

    def pack(t):
        try:
            key, nbytes = _storage_key(t)
        except (RuntimeError, NotImplementedError):
            return t
        seen[key] = max(seen.get(key, 0), nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return sum(seen.values()), out


def layer_saved_mib(layer, x, **kwargs) -> float:
    """MiB one attention layer keeps for backward on input x (B, N, d_model)."""
    nbytes, _ = saved_bytes(layer, x.requires_grad_(True), **kwargs)
    return nbytes / 2**20


def peak_allocated_bytes(fn, *args, **kwargs) -> tuple[int, object]:
    """(the peak of CPU bytes held by torch's allocator while `fn(*args, **kwargs)` runs, above what
    was held when it started; its result), exact: the profiler's record of every allocation and
    free, replayed in order. Counts the calling thread's allocations (run torch single-threaded
    for the whole picture); peak RSS adds the C library's slack to this."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args, **kwargs)
    sizes, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
    held = peak = 0
    for _, size in sorted(sizes):
        held += size
        peak = max(peak, held)
    return peak, out


def memory_limit(gb) -> float:
    """Bytes a point may take: `gb` GiB (task.memory_limit_gb), or, when null, 80% of the memory
    free now (the rest is the system's and this process's own)."""
    if gb is None:
        return 0.8 * psutil.virtual_memory().available
    if not isinstance(gb, (int, float)) or isinstance(gb, bool) or not 0 < gb < float("inf"):
        from repro.common.errors import ConfigError

        raise ConfigError(f"task.memory_limit_gb={gb!r}: give a positive number of GiB, or null for 80% of the "
                          f"memory free at the start")
    return gb * 2**30


def out_of_memory(err: BaseException) -> str | None:
    """The first line of err when it is running out of memory (torch's OutOfMemoryError, Python's
    MemoryError, an allocator's RuntimeError), else None."""
    msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
            isinstance(err, RuntimeError) and any(m in msg for m in OOM_MARKERS)):
        return msg[:200]
    return None


def over_limit(needed: float, limit: float, what: str) -> dict | None:
    """An 'oom' row's status and reason when `needed` bytes (an estimate of what a point must
    allocate, before it allocates any) pass the limit, else None."""
    if needed <= limit:
        return None
    return {"status": "oom", "reason": f"{what} needs at least {needed / 2**30:.3g} GiB, over the limit of "
                                       f"{limit / 2**30:.3g} GiB (estimated before allocating)"}


@contextlib.contextmanager
def memory_cap(limit: float, device):
    """While inside, this process may map at most `limit` more bytes (Linux, CPU runs: the soft
    RLIMIT_AS, raised back on leaving): an allocation past it fails at once (torch's RuntimeError,
    a MemoryError; out_of_memory() names it) instead of the operating system's OOM killer ending
    the process later. On a GPU, or where the limit cannot be set, a no-op: there the device's own
    allocator raises torch.OutOfMemoryError. Run a point's code once, small, before entering: a
    lazy import that fails half-way under the cap leaves its module broken for the process."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = int(psutil.Process().memory_info().vms + limit)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:  # already tighter: keep it
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def cap_gpu_memory(device, gb) -> float | None:
    """task.gpu_memory_gb: let this process use at most `gb` GiB of the GPU's memory (the rest is
    an out-of-memory error to torch), so that a large GPU runs out where a smaller one did (the
    paper's 11 GB GTX 1080 Ti: softmax stopped at 4,096, LSH at 16,384). Returns the fraction set."""
    from repro.common.errors import ConfigError

    if gb is None:
        return None
    if not isinstance(gb, (int, float)) or isinstance(gb, bool) or not 0 < gb < float("inf"):
        raise ConfigError(f"task.gpu_memory_gb={gb!r}: give a positive number of GiB, or null for the whole GPU")
    if device.type != "cuda":
        raise ConfigError(f"task.gpu_memory_gb={gb} caps a GPU's memory, and this run is on {device.type}; "
                          "on a CPU the cap is task.memory_limit_gb")
    total = torch.cuda.get_device_properties(device).total_memory
    if gb * 2**30 > total:
        raise ConfigError(f"task.gpu_memory_gb={gb}: the GPU has {total / 2**30:.1f} GiB")
    fraction = gb * 2**30 / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
