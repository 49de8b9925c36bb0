"""task=kernels: causal_dot_product implementations timed against each other on this device:
the chunked path, the dispatcher (whatever it picks here: the fused C kernel on a CPU, the CuPy
kernels on a GPU once verified), the per-step loop (the RNN definition) and the naive masked
(N, N) formula. Forward and forward+backward; rows, a table, the ratios, and the kernel each ran
on (kernel_backend: the chunked path takes the fused C kernel on a CPU as the dispatcher does). A
point whose least memory (needed_bytes) passes the limit (task.memory_limit_gb, else 80% of the
memory free) is an 'oom' row before it allocates, and one that passes it while running (the
process is capped: repro.training.memory) is one too; the next point runs. Timed by
repro.common.timing.time_product, as python -m repro.reproduction.bench (the GPU kernels against
their outside peers) and python -m repro.reproduction.cpu_speed (the CPU-speed targets) time it."""
import sys
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from repro.common import timing
from repro.common.config import parse_device, parse_dtype, positive_ints
from repro.common.errors import ConfigError
from repro.common.results import atomic_write, check_publish, output_dirs, provenance, rows_to_csv, write_jsonl
from repro.conf import in_multirun, run_dir
from repro.kernels import causal_dot_product, causal_dot_product_chunked
from repro.kernels.causal_product.reference import causal_dot_product_loop, causal_dot_product_naive
from repro.training.backends import note_fallback, product_backend
from repro.training.memory import memory_cap, memory_limit, out_of_memory, over_limit

RAW_NAME = "kernels_rows.jsonl"  # the rows, beside the aggregate in a publish folder
IMPLEMENTATIONS = {"chunked": causal_dot_product_chunked, "dispatcher": causal_dot_product,
                   "loop": causal_dot_product_loop, "naive": causal_dot_product_naive}


def needed_bytes(name, b, h, n, d, m, el) -> tuple[float, float]:
    """(bytes of the inputs q, k, v and the upstream gradient; bytes one implementation needs beyond
    them at least): what a point must allocate, known before it allocates any."""
    inputs = b * h * n * (2 * d + 2 * m) * el
    beyond = {"naive": 2 * b * h * n * n * 8,  # the (N, N) scores in float64, and their masked copy
              "loop": b * h * n * d * m * el}.get(name, 0)  # autograd keeps every state S_i
    return inputs, inputs + beyond  # and the output and the three gradients, the inputs' size again


def kernel_fields(name, q, k, v) -> dict:
    """Which kernel an implementation runs on: the dispatcher's choice; the chunked path's own (the
    fused C kernel on a CPU, as the dispatcher's, but never the CUDA kernels); the references are
    PyTorch operations."""
    if name in ("loop", "naive"):
        return {"kernel_backend": "torch", "kernel_backend_why": f"the reference ({name})", "kernel_fallback": False}
    return product_backend(q, k, v, chunked=name == "chunked")


def _measure(name, q, k, v, g, device, t, limit) -> dict:
    """One implementation timed, forward and forward + backward (each the median of task.repeats
    calls after task.warmup, by the wall clock, the device synchronised around each call), under
    the memory cap: an allocation past it is an 'oom' row, not the operating system's OOM killer."""
    def in_turn(calls):
        return {x: timing.repeat(c, t.repeats, device, warmup=t.warmup).median for x, c in calls.items()}

    try:
        with memory_cap(limit, device):
            sec = timing.time_product({name: IMPLEMENTATIONS[name]}, lambda *_: ((q, k, v), g), timing.PASSES, in_turn)
        return {"status": "ok", "forward_ms": sec["fwd"][name] * 1e3, "forward_backward_ms": sec["fwd_bwd"][name] * 1e3}
    except (RuntimeError, MemoryError) as err:
        if (reason := out_of_memory(err)) is None:
            raise
        return {"status": "oom", "reason": reason}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run(cfg) -> float:
    t = cfg.task
    names = t.get("implementations")
    if names is None or len(names) == 0:
        raise ConfigError(f"task.implementations is empty; name at least one of {', '.join(IMPLEMENTATIONS)}")
    unknown = [i for i in names if i not in IMPLEMENTATIONS]
    if unknown:
        raise ConfigError(f"task.implementations: unknown {unknown}; valid: {', '.join(IMPLEMENTATIONS)}")
    lengths = positive_ints(t, "lengths", "[1024,4096]")
    device, dtype = parse_device(cfg.device), parse_dtype(t.dtype)
    limit = memory_limit(t.get("memory_limit_gb"))
    publishing = {"task": "kernels", "publish": t.get("publish"), "publish_replace": bool(t.get("publish_replace"))}
    if not in_multirun():  # the publish folder must take these rows: asked before the first N
        check_publish([{**publishing, "implementation": name, "n": n, "batch": t.batch, "seed": cfg.seed}
                       for n in lengths for name in names], RAW_NAME)
    out, meta, rows = run_dir(cfg), provenance(device), []
    el = torch.empty((), dtype=dtype).element_size()
    # Each implementation once at N = 4, outside the memory cap: their lazy imports and thread
    # pools are set up here (an import failing half-way under the cap would break the module).
    tiny = [torch.randn(1, 1, 4, x, device=device, dtype=dtype, requires_grad=True) for x in (t.d, t.d, t.m)]
    for name in names:
        torch.autograd.grad(IMPLEMENTATIONS[name](*tiny), tiny, torch.ones(1, 1, 4, t.m, device=device, dtype=dtype))
    for n in tqdm(lengths, desc="kernels", unit="N"):
        torch.manual_seed(cfg.seed)
        q = k = v = g = made = None  # the last N's tensors freed before this N's are made
        inputs = needed_bytes("chunked", t.batch, t.heads, n, t.d, t.m, el)[0]
        results = dict.fromkeys(names, over_limit(inputs, limit, f"the inputs at N={n}"))
        try:
            if results[names[0]] is None:
                with memory_cap(limit, device):  # all four, or none (q set only once every one is made)
                    made = [torch.randn(t.batch, t.heads, n, x, device=device, dtype=dtype, requires_grad=grad)
                            for x, grad in ((t.d, True), (t.d, True), (t.m, True), (t.m, False))]
                q, k, v, g = made
        except (RuntimeError, MemoryError) as err:
            if (reason := out_of_memory(err)) is None:
                raise
            results = dict.fromkeys(names, {"status": "oom", "reason": f"the inputs at N={n}: {reason}"})
        for name in names:
            result = results[name]
            kernel = kernel_fields(name, q, k, v) if q is not None else {}
            note_fallback(name, kernel)
            if result is None:
                result = over_limit(needed_bytes(name, t.batch, t.heads, n, t.d, t.m, el)[1], limit, f"{name} at N={n}")
            if result is None:
                result = _measure(name, q, k, v, g, device, t, limit)
            if result["status"] != "ok":
                tqdm.write(f"{name} N={n}: {result['status']}: {result['reason']}", file=sys.stderr)
            backend = (kernel.get("kernel_backend") if name == "dispatcher" else name)
            rows.append({"task": "kernels", "implementation": name, "backend": backend, "n": n, "batch": t.batch,
                         "heads": t.heads, "d": t.d, "m": t.m, "dtype": t.dtype, "seed": cfg.seed, **result, **kernel,
                         **meta, **publishing})
            write_jsonl(out / "results.jsonl", rows)
        q = k = v = g = None  # this N's inputs go before the next N's
    return aggregate(rows, out, publish=not in_multirun())


def aggregate(rows, out_dir, publish: bool = True) -> float:
    """kernels.csv and kernels.txt (each implementation's times, its ratio to the chunked path's,
    the kernel it ran on) in out_dir and, through the guarded publish_folder, in the rows' publish
    folder (publish=False: out_dir alone, as a sweep's job does)."""
    targets = output_dirs(rows, out_dir, RAW_NAME) if publish else [Path(out_dir)]  # refused before any write
    df = pd.DataFrame(rows)
    for col in ("forward_ms", "forward_backward_ms", "kernel_backend"):
        if col not in df:  # every point failed, or rows from before the kernel was recorded
            df[col] = float("nan") if col.endswith("_ms") else None
    ref = df[(df.implementation == "chunked") & (df.status == "ok")].set_index("n")
    for col in ("forward_ms", "forward_backward_ms"):
        df[f"{col}_vs_chunked"] = [r[col] / ref.loc[r.n, col] if r.n in ref.index else float("nan")
                                   for _, r in df.iterrows()]
    cols = ["implementation", "n", "status", "forward_ms", "forward_backward_ms", "forward_backward_ms_vs_chunked",
            "kernel_backend"]
    text = (f"causal_dot_product, B={df.batch.iloc[0]} H={df.heads.iloc[0]} D={df.d.iloc[0]} M={df.m.iloc[0]} "
            f"{df.dtype.iloc[0]} on {df.device.iloc[0]}\n" + df[cols].to_string(index=False, float_format="%.3f"))
    print(text)
    for d in targets:
        atomic_write(d / "kernels.csv", rows_to_csv(df.to_dict("records")))
        atomic_write(d / "kernels.txt", text + "\n")
    loop = df[df.implementation == "loop"].forward_backward_ms_vs_chunked
    return float(loop.min()) if len(loop) else float("nan")
