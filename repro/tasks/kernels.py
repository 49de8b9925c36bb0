"""task=kernels: causal_dot_product implementations timed against each other on this device:
the chunked path, the dispatcher (whatever it picks here: the chunked path on a CPU, the CuPy
kernels on a GPU once verified; the row names it), the per-step loop (the RNN definition) and
the naive masked (N, N) formula. Forward and forward+backward; rows, a table, the ratios.
(python -m repro.reproduction.bench times the GPU kernels against their outside peers.)"""
import statistics
import time

import pandas as pd
import torch
from tqdm import tqdm

from repro.cli.config import ConfigError, parse_device, parse_dtype, run_dir
from repro.common.results import atomic_write, provenance, publish_folder, rows_to_csv, write_jsonl
from repro.kernels import (
    causal_dot_product,
    causal_dot_product_chunked,
    causal_dot_product_loop,
    causal_dot_product_naive,
    select_backend,
)

IMPLEMENTATIONS = {"chunked": causal_dot_product_chunked, "dispatcher": causal_dot_product,
                   "loop": causal_dot_product_loop, "naive": causal_dot_product_naive}


def _time(fn, device, warmup, repeats):
    def once():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0
    for _ in range(warmup):
        once()
    return statistics.median(once() for _ in range(repeats))


def run(cfg) -> float:
    t = cfg.task
    unknown = [i for i in t.implementations if i not in IMPLEMENTATIONS]
    if unknown:
        raise ConfigError(f"task.implementations: unknown {unknown}; valid: {', '.join(IMPLEMENTATIONS)}")
    device, dtype = parse_device(cfg.device), parse_dtype(t.dtype)
    out, meta, rows = run_dir(cfg), provenance(device), []
    for n in tqdm(list(t.lengths), desc="kernels", unit="N"):
        torch.manual_seed(cfg.seed)
        q, k = (torch.randn(t.batch, t.heads, n, t.d, device=device, dtype=dtype, requires_grad=True) for _ in "qk")
        v = torch.randn(t.batch, t.heads, n, t.m, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(t.batch, t.heads, n, t.m, device=device, dtype=dtype)
        for name in t.implementations:
            fn = IMPLEMENTATIONS[name]
            with torch.no_grad():
                fwd = _time(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), device, t.warmup, t.repeats)
            both = _time(lambda fn=fn, q=q, k=k, v=v, g=g: torch.autograd.grad(fn(q, k, v), (q, k, v), g), device,
                         t.warmup, t.repeats)
            backend = select_backend(q, k, v)[0] if name == "dispatcher" else name
            rows.append({"task": "kernels", "publish": t.get("publish"),
                         "implementation": name, "backend": backend, "n": n, "batch": t.batch,
                         "heads": t.heads, "d": t.d, "m": t.m, "dtype": t.dtype, "seed": cfg.seed, "status": "ok",
                         "forward_ms": fwd * 1e3, "forward_backward_ms": both * 1e3, **meta})
            write_jsonl(out / "results.jsonl", rows)
    return aggregate(rows, out)


def aggregate(rows, out_dir) -> float:
    df = pd.DataFrame(rows)
    ref = df[df.implementation == "chunked"].set_index("n")
    for col in ("forward_ms", "forward_backward_ms"):
        df[f"{col}_vs_chunked"] = [r[col] / ref.loc[r.n, col] if r.n in ref.index else float("nan")
                                   for _, r in df.iterrows()]
    cols = ["implementation", "n", "forward_ms", "forward_backward_ms", "forward_backward_ms_vs_chunked"]
    text = (f"causal_dot_product, B={df.batch.iloc[0]} H={df.heads.iloc[0]} D={df.d.iloc[0]} M={df.m.iloc[0]} "
            f"{df.dtype.iloc[0]} on {df.device.iloc[0]}\n" + df[cols].to_string(index=False, float_format="%.3f"))
    print(text)
    publish = publish_folder(rows)
    for d in [out_dir] + ([publish] if publish else []):
        atomic_write(d / "kernels.csv", rows_to_csv(df.to_dict("records")))
        atomic_write(d / "kernels.txt", text + "\n")
    loop = df[df.implementation == "loop"].forward_backward_ms_vs_chunked
    return float(loop.min()) if len(loop) else float("nan")
