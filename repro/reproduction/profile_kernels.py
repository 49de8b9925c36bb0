"""Where the CUDA causal product's time goes, for the work on its speed:

    python -m repro.reproduction.profile_kernels --out-dir results/gpu/<device>/profile

At B = H = 8, D = M = 64 (the benchmark's point), for fp32 and bf16 and each N, the forward and
the forward + backward of repro.kernels.causal_product.cuda.causal_dot_product run under
torch.profiler, which sees every kernel on the device (CuPy's launches too): kernel_times.csv
gets each kernel's device time per call and its share of the pass. host_overhead.csv gets the
wall time per call of a tiny problem (B = H = 1, N = 64), where the GPU's work is a few
microseconds, so the time is the launch path's own, and host_profile.txt where it goes
(cProfile). --parts groups times the forward against the chunks each block walks
(chunks_per_group.csv); --parts layer one attention layer's forward + backward at the MNIST
model's shape, softmax against linear, in ms and CUDA kernels per call (layer.csv); --parts model
a training step of the whole MNIST model, wall against kernel-busy time (model.csv); --parts
variants the tensor-core kernel's switched-off variants against it (tc_variants.csv); --switch
STAGED (any of them) runs the other parts with that variant on (repro.kernels.plumbing.switches). With
Nsight Compute (`ncu`) on the PATH, --ncu also writes its details page (speed of light,
occupancy, warp stalls, memory) for the bf16 forward at N = 16k to ncu_fwd_bf16.txt (CSV after
ncu's own lines). Needs a CUDA GPU, torch and CuPy (no Hydra).
"""
import argparse
import contextlib
import math
import os
import shutil
import subprocess
import sys
from functools import partial

import torch

from repro.common import timing
from repro.common.results import atomic_write, provenance, rows_to_csv
from repro.kernels.plumbing import cuda_grid
from repro.kernels.plumbing.switches import switched
from repro.reproduction import bench, peers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def inputs(b, h, n, d, m, dtype, device, grad=False):
    """phi(q), phi(k), v (B, H, N, D|M) and an upstream gradient, as the benchmark makes them."""
    return bench.make_inputs(peers.Peer(None), b, h, n, d, m, dtype, device, grad)


def kernel_shares(events, calls: int) -> list[dict]:
    """profiler key averages -> one row per device kernel: us per call of the pass and share of
    the pass's device time (largest first). Events without device time (host ops) are left out."""
    kernels = []
    for e in events:
        total = getattr(e, "device_time_total", None)
        if total is None:
            total = getattr(e, "cuda_time_total", 0)
        # user annotations (record_function ranges such as Optimizer.step, which Kineto also shows on
        # the device) span kernels already counted and the gaps between them: not kernels
        on_device = str(getattr(e, "device_type", "")).endswith("CUDA")
        if total and on_device and not getattr(e, "is_user_annotation", False):
            kernels.append((e.key, total, e.count))
    whole = sum(t for _, t, _ in kernels) or 1.0
    return [{"kernel": name[:160], "us_per_call": total / calls, "launches_per_call": count / calls,
             "share": total / whole} for name, total, count in sorted(kernels, key=lambda x: -x[1])]


def busy_and_launches(kernels) -> tuple[float, float]:
    """(ms the device's kernels are busy, kernels launched) per call, from profile_pass's rows."""
    return sum(r["us_per_call"] for r in kernels) / 1000, sum(r["launches_per_call"] for r in kernels)


def profile_pass(fn, calls: int):
    """Device time of `calls` calls of fn by kernel (after two warm calls: compiles, caches)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return kernel_shares(prof.key_averages(), calls)


# CUDA event pairs: the median over 15 pairs of 3 calls each, after two warm calls (compiles, caches)
EVENTS = dict(repeats=15, warmup=2, calls=3, events=True)
HOST = dict(repeats=1, warmup=5, calls=200)  # the wall clock around 200 calls of a tiny problem, after 5


def group_counts(n_chunks: int) -> list[int]:
    """Chunks per group to try: from one group (a block per sequence and value tile walks it all)
    to 64 groups, each count's smallest cpg."""
    return sorted({-(-n_chunks // g) for g in (1, 2, 3, 4, 6, 8, 9, 12, 16, 24, 33, 64) if g <= n_chunks})


def host_profile(fn, calls: int = 100, top: int = 30) -> str:
    """cProfile of `calls` calls of fn (the host's side): the `top` functions by their own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def run_ncu(out_dir, n: int, timeout_s: float, switches=()) -> str:
    """Nsight Compute's details page for the bf16 forward's kernels at N = n; what happened, in words."""
    ncu = shutil.which("ncu")
    if ncu is None:
        return "ncu is not on PATH"
    cmd = [ncu, "--csv", "--page", "details", "--kernel-name", "regex:cdp_", "--launch-skip", "3",
           "--launch-count", "3", *[a for s in ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats",
                                              "MemoryWorkloadAnalysis", "SchedulerStats") for a in ("--section", s)],
           sys.executable, "-m", "repro.reproduction.profile_kernels", "--target", str(n),
           *(["--switch", *switches] if switches else [])]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"ncu passed its {timeout_s:.0f} s"
    atomic_write(os.path.join(out_dir, "ncu_fwd_bf16.txt"), res.stdout + ("\n# stderr:\n" + res.stderr[-4000:]))
    return f"ncu exit {res.returncode}"


def kernels_part(args, base, out_dir, cuda, device):
    """kernel_times.csv: each kernel's device time per call of the pass, B = H = 8, D = M = 64."""
    rows = []
    for dtype_name in args.dtypes:
        for n in args.lengths:
            for pass_name, grad in (("fwd", False), ("fwd_bwd", True)):
                (q, k, v), up = inputs(8, 8, n, 64, 64, DTYPES[dtype_name], device, grad)
                fn = timing.one_call(cuda.causal_dot_product, (q, k, v), up, grad)
                for r in profile_pass(fn, args.calls):
                    rows.append({**base, "task": "kernels.profile", "pass": pass_name, "dtype": dtype_name,
                                 "batch": 8, "heads": 8, "n": n, "d": 64, "m": 64, **r})
                    print(f"{dtype_name} N={n:6d} {pass_name:7s} {r['us_per_call']:9.1f} us "
                          f"{100 * r['share']:5.1f}%  {r['kernel'][:70]}", flush=True)
                del q, k, v, up, fn
                torch.cuda.empty_cache()
    atomic_write(os.path.join(out_dir, "kernel_times.csv"), rows_to_csv(rows))


def host_paths(cuda, q, k, v, up) -> dict:
    """The launch path's layers, each a call on the same tiny inputs: the bare launch, the
    custom op's forward (no autograd), its backward op called directly, and through autograd the
    forward and the forward + backward (so each layer's cost is a difference of two rows)."""
    q3, k3, v3 = (x.detach().flatten(0, 1) for x in (q, k, v))
    qd, kd, vd = (x.detach() for x in (q, k, v))

    def op_fwd():
        with torch.no_grad():
            cuda.causal_dot_product(qd, kd, vd)

    return {"launch": lambda: cuda.launch(q3, k3, v3), "op_fwd": op_fwd,
            "op_bwd": lambda: cuda.cdp_backward(qd, kd, vd, up),
            "fwd": lambda: cuda.causal_dot_product(q, k, v),  # the autograd graph built, unused
            "fwd_bwd": timing.one_call(cuda.causal_dot_product, (q, k, v), up, True)}


def host_part(args, base, out_dir, cuda, device):
    """host_overhead.csv: the wall time per call of a tiny problem along each layer of the launch
    path (host_paths); host_profile.txt: where the host spends the forward + backward (cProfile)."""
    host, profiles = [], []
    for dtype_name in args.dtypes:
        (q, k, v), up = inputs(1, 1, 64, 64, 64, DTYPES[dtype_name], device, True)
        for path, fn in host_paths(cuda, q, k, v, up).items():
            us = 1e6 * timing.repeat(fn, device=device, **HOST).median  # the launch path's own time
            if path == "fwd_bwd":
                profiles.append(f"## {dtype_name} {path}: {us:.1f} us per call\n{host_profile(fn)}")
            host.append({**base, "task": "kernels.host", "pass": path, "dtype": dtype_name, "batch": 1,
                         "heads": 1, "n": 64, "d": 64, "m": 64, "host_us_per_call": us})
            print(f"host: {dtype_name} {path}: {us:.1f} us per call (B = H = 1, N = 64)", flush=True)
    atomic_write(os.path.join(out_dir, "host_overhead.csv"), rows_to_csv(host))
    atomic_write(os.path.join(out_dir, "host_profile.txt"), "\n".join(profiles))


SWITCHES = ("BARE_SMEM", "VEC_LOADS", "STAGED")  # the switched-off tensor-core variants (their switches, upper case)
VARIANTS = ((), ("BARE_SMEM",), ("VEC_LOADS",), ("BARE_SMEM", "VEC_LOADS"), ("STAGED",))  # the switches on


def variants_part(args, base, out_dir, cuda, device):
    """tc_variants.csv: the bf16 product on the tensor-core kernel with each of its switched-off
    variants on (BARE_SMEM: only the shared memory the bare product uses, 3 blocks per H100 SM
    rather than 2; VEC_LOADS: 16-byte loads of Q and K; both; STAGED: the pipelined kernel of
    causal_dot_tc_staged.cu), interleaved, 3 rounds, B = H = 8, D = M = 64: the forward launch
    and the backward op (its three launches). Each variant's outputs must equal the plain
    kernel's (the same sums)."""
    rows = []
    for n in args.lengths:
        (q, k, v), up = inputs(1, 64, n, 64, 64, torch.bfloat16, device, grad=True)
        q, k, v = (x.detach() for x in (q, k, v))
        calls = {"fwd": lambda x=(q[0], k[0], v[0]): cuda.launch(*x, tensor_cores=True)[0],
                 "bwd": lambda x=(q, k, v, up): cuda.cdp_backward(*x)}
        for rnd in range(3):
            outs, at = {}, len(rows)
            for on in VARIANTS:
                variant, flags = "+".join(on) or "plain", {name.lower(): name in on for name in SWITCHES}
                with switched(**flags):
                    for pass_, fn in calls.items():
                        outs[variant, pass_] = _tensors(fn())
                        ms = 1e3 * timing.repeat(fn, device=device, **EVENTS).median
                        rows.append({**base, "task": "kernels.variants", "pass": pass_, "dtype": "bf16", "batch": 8,
                                     "heads": 8, "n": n, "d": 64, "m": 64, "variant": variant, **flags,
                                     "round": rnd, "ms": ms})
                        print(f"bf16 N={n:6d} {pass_} {variant:20s} round {rnd}: {ms:8.3f} ms", flush=True)
            for r in rows[at:]:  # each round's outputs against the plain kernel's in the same round
                r["same_output"] = all(torch.equal(a, b) for a, b in zip(outs["plain", r["pass"]],
                                                                          outs[r["variant"], r["pass"]]))
    atomic_write(os.path.join(out_dir, "tc_variants.csv"), rows_to_csv(rows))


def _tensors(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


# (name, REPRO_KERNEL or None for the dispatcher's choice): linear attention as it runs unforced
# (fp32: the chunked torch path) and on the CuPy kernels, beside SDPA softmax
LAYERS = (("softmax", None), ("linear", None), ("linear", "cupy"))


def layer_part(args, base, out_dir, cuda, device):
    """layer.csv: one attention layer's forward + backward at the MNIST model's shape (d_model
    256, 8 heads, batch 10, N = 784, causal): ms per call and CUDA kernels launched per call, for
    softmax (SDPA), linear as dispatched and linear on the CuPy kernels, in fp32 and bf16."""
    from repro.attention import LinearAttention, SoftmaxAttention
    from repro.kernels.plumbing.backend import forcing

    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for name, kernel in LAYERS:
            torch.manual_seed(0)
            cls = SoftmaxAttention if name == "softmax" else LinearAttention
            layer = cls(256, 8).to(device=device, dtype=dtype)
            x = torch.randn(10, 784, 256, device=device, dtype=dtype, requires_grad=True)
            up = torch.randn_like(x)

            def fn(layer=layer, x=x, up=up):
                torch.autograd.grad(layer(x, causal=True), (x, *layer.parameters()), up)

            with forcing(kernel) if kernel else contextlib.nullcontext():
                ms = 1e3 * timing.repeat(fn, device=device, **EVENTS).median
                kernels = profile_pass(fn, 5)
            busy, launches = busy_and_launches(kernels)
            rows.append({**base, "task": "kernels.layer", "attention": name, "kernel": kernel or "dispatcher",
                         "pass": "fwd_bwd", "dtype": dtype_name, "batch": 10, "heads": 8, "n": 784, "d_model": 256,
                         "ms": ms, "busy_ms": busy, "kernels_per_call": launches,
                         "top_kernel": kernels[0]["kernel"][:100] if kernels else ""})
            print(f"layer {name:8s} ({kernel or 'dispatcher'}) {dtype_name}: {ms:7.3f} ms, "
                  f"{rows[-1]['kernels_per_call']:.0f} kernels per forward + backward", flush=True)
    atomic_write(os.path.join(out_dir, "layer.csv"), rows_to_csv(rows))


# The MNIST model and training step as reproduce_gpu's step 6 runs them (conf/experiment/paper_mnist.yaml
# with paper_authors.yaml: concatenated position encoding, softmax's attention dropout 0.1, the authors'
# RAdam clipping each parameter's gradient, the trainer's global norm taken unclipped), in fp32
MODEL = dict(n_layers=8, d_model=256, n_heads=8, d_ff=1024, dropout=0.1, embedding_dropout=0.0, embedding="concat")
BATCH, VALUES = 10, 784


def model_part(args, base, out_dir, cuda, device):
    """model.csv: one training step (forward, backward, the authors' RAdam step) of the MNIST model, softmax
    against linear: wall ms per step (CUDA events), the ms its kernels are busy and how many it
    launches; model_kernels.csv: each attention's 25 busiest kernels. A step whose wall time is
    far above its busy time waits on the host's launches, not on the GPU's work."""
    from repro.attention import LinearAttention, SoftmaxAttention
    from repro.models.pixels import PixelTransformer
    from repro.training.radam import RAdam

    rows, kernel_rows = [], []
    for name, cls in (("softmax", partial(SoftmaxAttention, attention_dropout=0.1)), ("linear", LinearAttention)):
        torch.manual_seed(0)
        model = PixelTransformer(cls, n_mixtures=10, **MODEL).to(device)
        opt = RAdam(model.parameters(), lr=1e-4, weight_decay=0.01, decoupled_weight_decay=True, max_grad_norm=1.0)
        seq = torch.randint(0, 256, (BATCH, VALUES), device=device)

        def step(model=model, opt=opt, seq=seq):
            model.nll(seq).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)  # the trainer's logged norm
            opt.step()
            opt.zero_grad(set_to_none=True)

        ms = 1e3 * timing.repeat(step, device=device, **{**EVENTS, "repeats": 5, "calls": 2}).median
        kernels = profile_pass(step, 3)
        busy, launches = busy_and_launches(kernels)
        rows.append({**base, "task": "kernels.model", "attention": name, "dtype": "fp32", "batch": BATCH,
                     "n": VALUES - 1, **MODEL, "ms_per_step": ms,
                     "busy_ms_per_step": busy, "kernels_per_step": launches})
        kernel_rows += [{**base, "task": "kernels.model", "attention": name, **r} for r in kernels[:25]]
        print(f"model {name:8s}: {ms:7.2f} ms per step, kernels busy {rows[-1]['busy_ms_per_step']:.2f} ms, "
              f"{rows[-1]['kernels_per_step']:.0f} kernels", flush=True)
    atomic_write(os.path.join(out_dir, "model.csv"), rows_to_csv(rows))
    atomic_write(os.path.join(out_dir, "model_kernels.csv"), rows_to_csv(kernel_rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=None, help="where the files go (default results/profile/<device>)")
    ap.add_argument("--parts", nargs="+", default=["kernels", "host"],
                    choices=["kernels", "host", "groups", "layer", "model", "variants"],
                    help="kernels: kernel_times.csv; host: host_overhead.csv, host_profile.txt; groups: "
                    "chunks_per_group.csv, the forward's time against the chunks per group (the launch's gridDim.y); "
                    "layer: layer.csv, one attention layer's forward + backward at the MNIST model's shape; "
                    "model: model.csv, model_kernels.csv, a training step of the MNIST model, softmax against linear; "
                    "variants: tc_variants.csv, the tensor-core kernel's switched-off variants against it")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--switch", nargs="+", default=[], choices=SWITCHES,
                    help="turn these tensor-core variants on for every part but variants, which sets them itself "
                    "(files go to <out-dir>/<variants>/)")
    ap.add_argument("--ncu", action="store_true", help="also Nsight Compute's details for the bf16 forward at 16k")
    ap.add_argument("--ncu-timeout-s", type=float, default=90.0)
    ap.add_argument("--target", type=int, default=None, help=argparse.SUPPRESS)  # the process ncu profiles
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_kernels: needs a CUDA device (none is visible)", file=sys.stderr)
        return 2
    with switched(",".join(args.switch)):
        return _main(args)


def _main(args) -> int:
    from repro.kernels.causal_product import cuda

    device = torch.device("cuda", torch.cuda.current_device())
    if args.target is not None:  # under ncu: a few forward launches, nothing written
        (q, k, v), _ = inputs(8, 8, args.target, 64, 64, torch.bfloat16, device)
        for _ in range(6):
            cuda.causal_dot_product(q, k, v)
        torch.cuda.synchronize()
        return 0
    base = {**provenance(device), "switches": "+".join(sorted(args.switch))}
    out_dir = args.out_dir or os.path.join("results", "profile", base["device"].replace(" ", "_"))
    out_dir = os.path.join(out_dir, base["switches"]) if args.switch else out_dir  # beside the plain runs' files
    os.makedirs(out_dir, exist_ok=True)
    parts = {"kernels": kernels_part, "host": host_part, "groups": groups, "layer": layer_part,
             "model": model_part, "variants": variants_part}
    for part in args.parts:
        parts[part](args, base, out_dir, cuda, device)
    if args.ncu:
        print(run_ncu(out_dir, 16384, args.ncu_timeout_s, args.switch), flush=True)
    return 0


def groups(args, base, out_dir, cuda, device):
    """The forward's ms at each chunks-per-group count (the default's marked), B = H = 8, D = M = 64."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for dtype_name in args.dtypes:
        for n in args.lengths:
            (q, k, v), _ = inputs(1, 64, n, 64, 64, DTYPES[dtype_name], device)
            q, k, v = (x[0] for x in (q, k, v))  # (BH, N, D) contiguous, as launch takes them
            default, _, _ = cuda_grid.grid(64, n, 64, sms)
            for cpg in group_counts(-(-n // cuda_grid.CHUNK)):
                _, n_groups, n_mt = cuda_grid.grid(64, n, 64, sms, cpg)
                launch = partial(cuda.launch, q, k, v, cpg=cpg)
                ms = 1e3 * timing.repeat(launch, device=device, **EVENTS).median
                rows.append({**base, "task": "kernels.groups", "pass": "fwd", "dtype": dtype_name, "batch": 8,
                             "heads": 8, "n": n, "d": 64, "m": 64, "cpg": cpg, "n_groups": n_groups,
                             "blocks": 64 * n_groups * n_mt, "default": cpg == default, "ms": ms})
                print(f"{dtype_name} N={n:6d} cpg={cpg:5d} groups={n_groups:3d} blocks={64 * n_groups:5d} "
                      f"{ms:8.3f} ms{'  (default)' if cpg == default else ''}", flush=True)
    atomic_write(os.path.join(out_dir, "chunks_per_group.csv"), rows_to_csv(rows))


if __name__ == "__main__":
    sys.exit(main())
