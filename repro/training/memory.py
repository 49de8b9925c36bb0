"""What a forward pass keeps for its backward pass, counted exactly: every tensor autograd saves
passes through a saved_tensors_hooks pack hook, and the distinct storages behind them are summed
(a view of a kept tensor costs nothing more; a parameter counts once, as it would on a device).
This is exact for a given backend and input, where peak resident memory is noisy and includes
the allocator's slack; both are recorded by the benchmark (task=benchmark)."""
import torch


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
