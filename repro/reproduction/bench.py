"""Benchmark of the causal dot product against its peers, all in one run:

    python -m repro.reproduction.bench                       # B=H=8, D=M=64, N=1k..64k, fp32 and bf16
    python -m repro.reproduction.bench --lengths 1024 16384 --dtypes bf16 --repeats 20

Methods (one that cannot run here is a 'missing' row with the reason, never an error):
  cupy          this suite's CUDA kernels (repro.kernels.causal_product.cuda), whatever the switch
                gpu_verified says (bf16 on tensor cores, fp32 on the FMA kernel)
  cupy_norm     the same with the normaliser fused (the whole causal linear attention)
  torch         the chunked PyTorch path (repro.kernels.causal_product.chunked)
  fast_transformers   the authors' CUDA kernel, built from its sdist (repro.reproduction.peers)
  fla_chunk     flash-linear-attention's chunk_linear_attn (Triton), in its (B, N, H, D) layout
  sdpa          causal softmax attention, torch.nn.functional.scaled_dot_product_attention
  retention, gla, delta   the successors' chunked ops (repro.kernels): gated_causal_dot_product
                with RetNet's per-head decays (one per step), with GLA-like decays per key
                dimension (log sigmoid / 16), and delta_rule_dot_product (unit keys, beta in (0, 1))
  fla_retention, fla_gla, fla_delta   flash-linear-attention's chunk kernels for the same three
for the forward pass ('fwd') and forward + backward ('fwd_bwd'). q and k are elu(x) + 1
features, as the linear attention feeds them (the fused normaliser divides by q . sum k).

Timing on CUDA: each event pair spans `--calls` calls, each after a write of a buffer twice the
L2 cache (so no call finds the previous one's data in L2, and the flush gives the host time to
queue the next call); the flushes alone are timed the same way and subtracted. The row's ms is
the median over `--repeats` pairs, per call. On a CPU the same with a wall clock and no flush.
A slow point takes fewer calls and pairs (--point-budget-s); one whose single warm call passes
--max-call-s is 'skipped', with the longer N of that method (the fp32 SDPA at 64k, say). A first
call over the limit is retried once, since it may carry a compile (fla's Triton kernels).

The bandwidth floor: the bytes a pass must move at least (fwd: read q, k, v and write out;
fwd_bwd: that plus read q, k, v, g and write the three gradients) over the copy bandwidth
measured in this run; pct_of_floor = 100 * floor_ms / ms. Rows are appended to
<out-dir>/bench.jsonl as they are measured; a point already measured there (ok or oom) is not
measured again, so a rerun resumes (--again names methods whose points are measured anew, unless
measured at this commit, after a change to them; a point's last row wins). At the end bench.csv
(each point's last row, with `vs_<peer>` = peer_ms / ms at the same point: above 1 is faster than
that peer) is written atomically (the successors' rows also carry `vs_fla` against their own fla peer). Needs only torch
and numpy (and CuPy for the cupy methods).
"""
import argparse
import importlib.metadata
import json
import os
from functools import partial

import torch
import torch.nn.functional as F

from repro.common import timing
from repro.common.results import REPO, atomic_write, provenance, read_jsonl, rows_to_csv
from repro.kernels import causal_dot_product_chunked, delta_rule_dot_product, gated_causal_dot_product
from repro.kernels.causal_product import cuda as product_cuda
from repro.kernels.normalised import cuda as normalised_cuda
from repro.reproduction import peers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PEERS = ("fast_transformers", "fla_chunk", "sdpa")
SUCCESSORS = {"retention": "fla_retention", "gla": "fla_gla", "delta": "fla_delta"}  # op -> its fla peer
METHODS = ("cupy", "cupy_norm", "torch", *PEERS, *SUCCESSORS, *SUCCESSORS.values())
KEY = ("method", "pass", "dtype", "n", "batch", "heads", "d")  # one measured point


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _methods(device, ft_sdist=None):
    """name -> peers.Peer for this device."""
    cupy_why = None
    if device.type != "cuda":
        cupy_why = "missing: the CuPy kernels run on CUDA only"
    else:
        try:
            import cupy  # noqa: F401
        except ImportError as err:
            cupy_why = f"missing: CuPy is not importable ({err})"
    fused = lambda q, k, v: normalised_cuda.causal_linear_attention(q, k, v, 1e-6)
    return {
        "cupy": peers.Peer(None if cupy_why else product_cuda.causal_dot_product, cupy_why),
        "cupy_norm": peers.Peer(None if cupy_why else fused, cupy_why),
        "torch": peers.Peer(causal_dot_product_chunked),
        "fast_transformers": peers.fast_transformers(device, ft_sdist),
        "fla_chunk": peers.fla_chunk(device),
        "sdpa": peers.Peer(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "retention": peers.Peer(gated_causal_dot_product, extra="per_step"),
        "gla": peers.Peer(gated_causal_dot_product, extra="per_dim"),
        "delta": peers.Peer(delta_rule_dot_product, extra="beta"),
        **{name: peers.fla_successor(name, device) for name in SUCCESSORS.values()},
    }


# A point skipped as too slow, judged by a warm call. Rows of the older wording ("skipped: one call
# takes ...", judged by the first call, which carries fla's Triton compile) are measured again.
WARM_SKIP = "a warm call takes"


class TooSlow(Exception):
    """One call takes longer than the benchmark allows a call."""


class Timer:
    """ms per call of fn: CUDA events around `calls` calls, each after an L2 flush, minus the
    flushes alone; on a CPU a wall clock around `calls` calls. A point whose first call shows
    that calls x repeats would pass `budget_s` gets fewer of both (at least one pair of one)."""

    def __init__(self, device, calls=5, budget_s=None, max_call_s=None):
        self.device, self.calls, self.budget_s, self.max_call_s = device, calls, budget_s, max_call_s
        self.flush_bytes = 0
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
            self.flush_bytes = 2 * l2
            self.buffer = torch.empty(self.flush_bytes, dtype=torch.uint8, device=device)

    def _flushed(self, fn):
        """fn after an L2 flush (on CUDA): no call finds the previous one's data in L2."""
        if not self.flush_bytes:
            return fn

        def run():
            self.buffer.zero_()
            fn()
        return run

    def __call__(self, fn, warmup, repeats):
        """(ms per call, calls per pair, pairs)."""
        call_ms = 1e3 * timing.time_calls(fn, self.device).seconds  # the first warm-up call: how long may it take?
        warmed = 1
        if self.max_call_s and call_ms > 1e3 * self.max_call_s:
            # A first call can carry a one-off cost (Triton compiles and autotunes fla's kernels
            # there: 28 s on the H100); only a second, warm call that is as slow skips the point.
            call_ms, warmed = 1e3 * timing.time_calls(fn, self.device).seconds, 2
            if call_ms > 1e3 * self.max_call_s:
                raise TooSlow(f"{WARM_SKIP} {call_ms / 1e3:.1f} s (over --max-call-s {self.max_call_s})")
        first_ms = call_ms
        calls = self.calls
        if self.budget_s:
            allowed = max(1, int(1e3 * self.budget_s / max(first_ms, 1e-3)))  # calls that fit the budget
            calls = max(1, min(calls, allowed // max(repeats, 1)))
            repeats = max(1, min(repeats, allowed // calls))
        timing.warm_up(fn, warmup - warmed)
        pairs = dict(device=self.device, calls=calls, events=True)
        total = timing.repeat(self._flushed(fn), repeats, **pairs).median
        flush = timing.repeat(self.buffer.zero_, repeats, **pairs).median if self.flush_bytes else 0.0
        return 1e3 * max(total - flush, 0.0), calls, repeats


def copy_bandwidth(device, nbytes=None, repeats=10):
    """Copy bandwidth in bytes/s (each copy reads and writes nbytes)."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms, _, _ = Timer(device, calls=1)(lambda src=src, dst=dst: dst.copy_(src), 2, repeats)
    del src, dst
    return 2 * nbytes / (max(ms, 1e-6) / 1e3)


def _extra(kind, h, d, layout, shape, mk, device):
    """The successors' fourth input, in the peer's layout (shape(x): (B, H, N, x) or (B, N, H, x)):
    RetNet's per-head log decays (fixed: no gradient), GLA-like log decays log sigmoid(.) / 16,
    or beta in (0, 1)."""
    if kind == "per_step":
        log_gamma = (1 - 2.0 ** (-5.0 - torch.arange(h, dtype=torch.float32, device=device))).log()
        return (log_gamma[:, None] if layout == "bhnd" else log_gamma).expand(shape(1)[:-1]).contiguous(), False
    if kind == "per_dim":
        return F.logsigmoid(mk(d)) / 16, True
    return torch.sigmoid(mk(1)[..., 0]), True


def make_inputs(peer, b, h, n, d, m, dtype, device, backward):
    """q, k elu(x) + 1 features (unit keys for the delta rule), v, the successors' extra input,
    and the output gradient, in the peer's layout."""
    g = torch.Generator(device=device).manual_seed(n)
    shape = (lambda x: (b, h, n, x)) if peer.layout == "bhnd" else (lambda x: (b, n, h, x))
    mk = lambda x: torch.randn(*shape(x), device=device, generator=g, dtype=torch.float32)
    q, k = (F.elu(mk(d) * 0.5) + 1 for _ in "qk")
    if peer.extra == "beta":
        k = F.normalize(k, dim=-1)
    xs = [x.to(dtype).requires_grad_(backward) for x in (q, k, mk(m) * 0.5)]
    if peer.extra:
        x, learned = _extra(peer.extra, h, d, peer.layout, shape, mk, device)
        # fla takes its decays and betas in the inputs' dtype; ours keep fp32 decays, as the layers do
        xs.append(x.to(dtype if peer.layout == "bnhd" else torch.float32).requires_grad_(backward and learned))
    return xs, mk(m).to(dtype)


def _append(path, row):
    """One row, appended and on disk before the next point starts."""
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def with_ratios(rows):
    ok = {(r["method"], r["dtype"], r["n"], r["pass"]): r["ms"] for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok":
            for peer in ("torch", *PEERS):
                other = ok.get((peer, r["dtype"], r["n"], r["pass"]))
                if other is not None and peer != r["method"]:
                    r[f"vs_{peer}"] = other / r["ms"]
            fla = ok.get((SUCCESSORS.get(r["method"]), r["dtype"], r["n"], r["pass"]))
            if fla is not None:
                r["vs_fla"] = fla / r["ms"]
    return rows


def _error(err):
    text = str(err).splitlines()[0][:200] if str(err) else ""
    return f"error: {type(err).__name__}: {text}"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m repro.reproduction.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2 ** i for i in range(10, 17)])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64, help="D = M")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--again", nargs="+", default=[], metavar="METHOD",
                    help="measure these methods' points again unless measured at this commit (after a change to "
                    "them; a rerun resumes): bench.csv takes the new rows, bench.jsonl keeps both")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10, help="event pairs per point (the median is kept)")
    ap.add_argument("--calls", type=int, default=5, help="calls per event pair")
    ap.add_argument("--point-budget-s", type=float, default=8.0, help="a point whose warm call shows that "
                    "calls x repeats would take longer gets fewer of both")
    ap.add_argument("--max-call-s", type=float, default=20.0, help="a point whose warm call takes longer "
                    "(a first call that does is retried once: it may compile) is 'skipped', and so are the "
                    "longer N of that method, pass and dtype")
    ap.add_argument("--device", default=None, help="cuda (default when one is visible) or cpu")
    ap.add_argument("--ft-sdist", default=None, help="the pytorch-fast-transformers-0.4.0 sdist "
                    "(default: $REPRO_FT_SDIST, else gpu_bundle/)")
    ap.add_argument("--out-dir", default=None, help="default results/kernels/<device>/")
    args = ap.parse_args(argv)
    methods_known = METHODS
    unknown = sorted(set(args.methods + args.again) - set(methods_known))
    if unknown:
        ap.error(f"--methods: unknown {unknown}; valid: {', '.join(methods_known)}")
    if min(args.lengths) < 1 or min(args.batch, args.heads, args.dim, args.repeats, args.calls) < 1:
        ap.error("--lengths, --batch, --heads, --dim, --repeats and --calls must be positive")
    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_name not in ("cuda", "cpu") or (dev_name == "cuda" and not torch.cuda.is_available()):
        ap.error(f"--device {dev_name!r}: valid: cpu, or cuda on a machine with a visible GPU")
    device = torch.device("cuda", torch.cuda.current_device()) if dev_name == "cuda" else torch.device("cpu")

    methods = _methods(device, args.ft_sdist)
    base = provenance(device)
    base["versions"] = {**base["versions"], "cupy": _version("cupy-cuda13x") or _version("cupy-cuda12x"),
                        "flash-linear-attention": _version("flash-linear-attention"),
                        "fla-core": _version("fla-core"), "triton": _version("triton")}
    out_dir = args.out_dir or REPO / "results" / "kernels" / base["device"].replace(" ", "_").replace("/", "_")
    os.makedirs(out_dir, exist_ok=True)
    rows_path = os.path.join(out_dir, "bench.jsonl")
    rows = read_jsonl(rows_path) if os.path.exists(rows_path) else []
    # a rerun measures again only what did not finish: not the missing peers nor the errors
    current = [r for r in rows if r["method"] not in args.again or r.get("git_sha") == base["git_sha"]]
    done = {tuple(r.get(c) for c in KEY) for r in current
            if r["status"] in ("ok", "oom") or r["status"].startswith(f"skipped: {WARM_SKIP}")}
    timer = Timer(device, args.calls, args.point_budget_s, args.max_call_s)

    def in_turn(calls):  # one method at a time (a point's row is written before the next is timed)
        return {name: timer(call, args.warmup, args.repeats) for name, call in calls.items()}

    def inputs_of(peer, n, dtype, _, backward):
        return make_inputs(peer, args.batch, args.heads, n, args.dim, args.dim, dtype, device, backward)
    too_slow = {}  # (method, pass, dtype) -> the N whose warm call was over --max-call-s
    for r in current:
        if (r["status"].startswith(f"skipped: {WARM_SKIP}")
                and (r["batch"], r["heads"], r["d"]) == (args.batch, args.heads, args.dim)):
            key = (r["method"], r["pass"], r["dtype"])
            too_slow[key] = min(too_slow.get(key, r["n"]), r["n"])
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s on {base['device']}; rows -> {rows_path}")
    b, h, d = args.batch, args.heads, args.dim
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for n in args.lengths:
            tensor_bytes = b * h * n * d * (torch.finfo(dtype).bits // 8)
            for pass_name, n_tensors in (("fwd", 4), ("fwd_bwd", 11)):
                floor_ms = n_tensors * tensor_bytes / bandwidth * 1e3
                for name in args.methods:
                    peer = methods[name]
                    row = {**base, "task": "kernels.bench", "method": name, "pass": pass_name,
                           "dtype": dtype_name, "batch": b, "heads": h, "n": n, "d": d, "m": d, "seed": n,
                           "calls_per_event_pair": args.calls, "l2_flush_bytes": timer.flush_bytes,
                           "copy_bandwidth_gbs": bandwidth / 1e9, "floor_ms": floor_ms}
                    if tuple(row[c] for c in KEY) in done:  # measured by an earlier run
                        continue
                    if peer.fn is None:
                        row["status"] = peer.why
                    elif n > too_slow.get((name, pass_name, dtype_name), n):
                        row["status"] = f"skipped: N={too_slow[(name, pass_name, dtype_name)]} was over --max-call-s"
                    elif dtype not in peer.dtypes:
                        row["status"] = f"missing: {name} takes {', '.join(str(t) for t in peer.dtypes)} only"
                    else:
                        try:
                            inputs = partial(inputs_of, peer, n, dtype)
                            ms, calls, pairs = timing.time_product({name: peer.fn}, inputs, [pass_name],
                                                                   in_turn)[pass_name][name]
                            row.update(status="ok", ms=ms, pct_of_floor=100 * floor_ms / max(ms, 1e-9),
                                       calls_per_event_pair=calls, event_pairs=pairs)
                        except TooSlow as err:
                            row["status"] = f"skipped: {err}"
                            too_slow[(name, pass_name, dtype_name)] = n
                        except torch.OutOfMemoryError:
                            row["status"] = "oom"
                        except Exception as err:  # a peer that cannot take this dtype or size
                            row["status"] = _error(err)
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    _append(rows_path, row)
                    rows.append(row)
                    print(f"{dtype_name} N={n:6d} {pass_name:7s} {name:18s} "
                          + (f"{row['ms']:9.3f} ms  {row['pct_of_floor']:5.1f}% of floor" if row["status"] == "ok"
                             else row["status"]))
    csv_path = os.path.join(out_dir, "bench.csv")
    latest = list({tuple(r.get(c) for c in KEY): r for r in rows}.values())  # a point's last row
    atomic_write(csv_path, rows_to_csv(with_ratios(latest)))
    print(f"{len(latest)} points in {csv_path} (with the ratios), every row in {rows_path}")
    return latest


if __name__ == "__main__":
    main()
