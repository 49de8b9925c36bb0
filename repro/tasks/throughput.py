"""task=throughput: the paper's generation-speed tables (Tables 1, 2, 4, 5). Images sampled
pixel by pixel from untrained MNIST- and CIFAR-10-sized models (speed does not depend on the
weights): seconds per image at batch 1 and images per second at a larger batch, for linear
attention's RNN form, softmax with a key/value cache ("stateful softmax"), softmax re-running
the whole prefix for every pixel (the paper's baseline) and, when present, LSH (re-run too).

A generation that would take longer than task.time_budget_s is stopped and its total
extrapolated, and its row says so: recurrent steps from a linear fit of step time against
position; re-run steps by timing the forward pass at probe positions over the rest of the
image and integrating.

Two more kinds of row put the numbers in context. A method with `compile: <backend>` samples
through a torch.compile'd step (compiled before timing, on a short warm-up generation; the
compile time is its own column); one with `graph: true` (CUDA, a state of fixed size) replays
the whole step, every layer and the sampling, as one CUDA graph (repro.models.generate.
GraphedSteps; captured before timing, its time in graph_s). Mode `floor` runs no model: it times the matrix products of
one step alone (every weight matrix read once, as every generated token must) and multiplies by
the image's length, the floor under any step at batch 1, where reading the weights from memory
is the cost.

A method whose least memory (weights, and its state, key/value cache or re-run activations: see
needed_bytes) passes the limit (task.memory_limit_gb, else 80% of the memory free) is an 'oom'
row before it allocates; inside, the process is capped at the limit (repro.training.memory), so
an allocation past it is an 'oom' row too, and the next method runs. Every row names the kernel
its attention ran on (repro.training.backends).
"""
import contextlib
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch._dynamo
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tqdm import tqdm

from repro.attention.softmax import SoftmaxAttention
from repro.common import paper, timing
from repro.common.config import nonempty, parse_device, parse_dtype, positive_ints
from repro.common.errors import ConfigError, building_from_config
from repro.common.results import atomic_write, check_publish, output_dirs, provenance, rows_to_csv, write_jsonl
from repro.conf import compose_group, in_multirun, run_dir
from repro.models import logistic_mixture as dmol
from repro.models.generate import MODES, GraphedSteps, StepProjections, compile_step, generate
from repro.models.pixels import IMAGE_SHAPES, PixelTransformer
from repro.training.backends import layer_backend, model_attention, note_fallback, step_backend
from repro.training.loop import compile_backends
from repro.training.memory import memory_cap, memory_limit, out_of_memory, over_limit
from repro.training.threads import set_threads

TASK_MODES = MODES + ("floor",)

LAYERS = {"mnist": 8, "cifar": 16}  # the paper's depths; the layer itself comes from `model`
RAW_NAME = "throughput_rows.jsonl"  # the rows, beside the aggregate in a publish folder


class _OverBudget(Exception):
    pass


def time_generation(model, length, batch, mode, budget, device, probes, graphed=None):
    """(total seconds, positions measured, extrapolated?, process CPU seconds) for one batch of
    images. CPU time (all this process's threads) barely moves with other processes' load on a
    shared machine, where wall time does; an extrapolated total scales it by the same ratio as
    the wall time."""
    first = torch.zeros(batch, 1, dtype=torch.long, device=device)
    stamps = []  # seconds since the start, the device synchronised, after each sampled position

    def on_step(t):
        stamps.append(watch.wall())
        if stamps[-1] > budget:
            raise _OverBudget

    watch = timing.Stopwatch(device)
    try:
        generate(model, first, length, dmol.sample, mode=mode, on_step=on_step, graphed=graphed)
        return stamps[-1], length - 1, False, watch.cpu()
    except _OverBudget:
        cpu = watch.cpu()
    done = len(stamps)  # positions 1..done sampled
    per_step = np.diff([0.0] + stamps)  # (done,): the cost of sampling position t = 1..done
    positions = np.arange(1, done + 1)
    rest = np.arange(done + 1, length)
    if mode == "recurrent":  # constant (RNN state) or linearly growing (cache) cost per step
        fit = slice(done // 4, None)  # past the first steps' warm-up
        if done - done // 4 >= 8:
            slope, intercept = np.polyfit(positions[fit], per_step[fit], 1)
            estimate = float(np.clip(intercept + slope * rest, 0, None).sum())
        else:  # too few steps to see a trend
            estimate = float(per_step[fit].mean() * len(rest))
    else:  # a forward pass over t tokens per step: time it at probe positions and integrate
        probe_at = np.unique(np.linspace(rest[0], rest[-1], probes).astype(int))
        costs = []
        with torch.no_grad():
            for t in probe_at:
                tokens = torch.randint(0, 256, (batch, int(t)), device=device)
                costs.append(timing.time_calls(lambda x=tokens: dmol.sample(model(x)[:, -1]), device).seconds)
        estimate = float(np.interp(rest, probe_at, costs).sum())
    total = float(per_step.sum()) + estimate
    return total, done, True, cpu * total / float(per_step.sum())


def _matrices(model):
    """(bias, weight^T) of every matrix product in one generation step, in the step's order."""
    mats = []
    for layer in model.encoder.layers:
        a = layer.attention
        mats += [StepProjections(a).weights()[::-1], (a.out_proj.bias, a.out_proj.weight.t()),
                 (layer.linear1.bias, layer.linear1.weight.t()), (layer.linear2.bias, layer.linear2.weight.t())]
    return mats + [(model.head.bias, model.head.weight.t())]


@torch.no_grad()
def time_floor(model, length, batch, device, steps=200):
    """(total seconds, steps timed, False, process CPU seconds, GB/s) of the matrix products of
    length - 1 steps, timed over `steps` of them: the step's cost with nothing but its weights
    read (batch rows at a time)."""
    mats = _matrices(model)
    xs = {w.shape[0]: torch.randn(batch, w.shape[0], device=device, dtype=w.dtype) for _, w in mats}

    def one_step():
        for b, w in mats:
            torch.addmm(b, xs[w.shape[0]], w)

    timing.warm_up(one_step, 10)
    per_step, cpu_per_step = timing.time_calls(one_step, device, calls=steps)
    gbps = sum(w.numel() * w.element_size() for _, w in mats) / per_step / 1e9
    return per_step * (length - 1), steps, False, cpu_per_step * (length - 1), gbps


def compile_generation(model, backend, length, batch, device, sample_fn=dmol.sample):
    """Compile the model's step, with the sampling after it, in place and warm it up. Two short
    generations give every graph a generation uses its first and, where positions 0 and 1 were
    specialized, its general compile: the first step (which builds the state), the steady
    several-token step, and the one-token step of a tail (the second is one token longer).
    Returns the seconds spent."""
    # Every model's step shares one code object, and dynamo's per-code cache limit would send a
    # later method back to eager, silently, after earlier methods and sizes filled it.
    torch._dynamo.reset()
    watch = timing.Stopwatch(device)
    compile_step(model, backend, sample_fn=sample_fn)  # sampling inside the compiled step
    first = torch.zeros(batch, 1, dtype=torch.long, device=device)
    for n in (8, 9):
        generate(model, first, min(length, n), sample_fn)
    return watch.wall()


def needed_bytes(model, mode, batch, length) -> float:
    """What a generation must hold at least, before it allocates any of it: the weights, and the
    state a step carries (linear: S and Z per layer; a key/value cache: keys and values of every
    position), or a re-run's widest activation (the whole prefix through one layer)."""
    el = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    att, layers = model_attention(model), len(model.encoder.layers)
    d_model, d_ff = model.encoder.layers[0].linear1.in_features, model.encoder.layers[0].linear1.out_features
    if mode == "floor":  # one input row per batch entry for each width of matrix
        return weights + batch * (d_model + d_ff) * el
    if mode == "recurrent" and isinstance(att, SoftmaxAttention):  # the cache, preallocated or grown to length
        return weights + layers * 2 * batch * length * att.n_heads * att.d_values * el
    if mode == "recurrent" and att is None:  # a user's module: its state unknown, the weights at least
        return weights
    if mode == "recurrent":  # a state of (D, M) per head (linear, the successors), or a window (local): at least
        return weights + layers * batch * att.n_heads * att.d_keys * att.d_values * max(el, 4)
    return weights + batch * length * (8 + 2 * d_ff * el)  # the tokens, and one layer's widest activation twice


def kernel_fields(model, mode, backend, batch, length, dtype, device, graph=False) -> dict:
    """The kernel a method's attention runs on (repro.training.backends)."""
    if mode == "floor":
        return {"kernel_backend": "torch", "kernel_backend_why": "matrix products alone (no attention)",
                "kernel_fallback": False}
    att = model_attention(model)
    if mode == "recurrent":
        fields = step_backend(att, batch, dtype, device)
        if backend:
            fields["kernel_backend_why"] += f"; the step compiled by torch.compile ({backend})"
        if graph:
            fields["kernel_backend_why"] += "; the whole step replayed as one CUDA graph"
        return fields
    return layer_backend(att, batch, length, dtype, device, causal=True, grad=False)


def run(cfg) -> float:
    t = cfg.task
    device, dtype = parse_device(cfg.device), parse_dtype(t.dtype)
    sizes = nonempty(t, "sizes", "[mnist]")
    batches = positive_ints(t, "batches", "[1,10]")
    unknown = [s for s in sizes if s not in LAYERS]
    if unknown:
        raise ConfigError(f"task.sizes: unknown {unknown}; valid: {', '.join(LAYERS)}")
    chosen_labels = t.get("run_methods")  # a preset names a subset: it cannot delete keys of task.methods
    if chosen_labels is not None and (bad := [x for x in chosen_labels if x not in t.methods]):
        raise ConfigError(f"task.run_methods: unknown {bad}; valid: {', '.join(t.methods)}")
    methods = {}
    for label, m in t.methods.items():
        if chosen_labels is not None and label not in chosen_labels:
            continue
        if m.mode not in TASK_MODES:
            raise ConfigError(f"task.methods.{label}.mode={m.mode!r}; valid: {', '.join(TASK_MODES)}")
        backend = m.get("compile")
        if backend and m.mode != "recurrent":
            raise ConfigError(f"task.methods.{label}.compile={backend!r}: only a recurrent step is compiled; "
                              f"mode is {m.mode!r}")
        if backend and backend not in (valid := compile_backends()):
            raise ConfigError(f"task.methods.{label}.compile={backend!r}; valid: {', '.join(valid)}")
        graph = bool(m.get("graph", False))
        if graph and (m.mode != "recurrent" or backend or device.type != "cuda"):
            raise ConfigError(f"task.methods.{label}.graph=true: a CUDA graph replays an eager recurrent step on "
                              f"device=cuda; here mode={m.mode}, compile={backend}, device={device.type}")
        methods[label] = (m.attention, m.mode, compose_group("attention", m.attention), m.get("settings") or {},
                          backend, graph)
    if not methods:
        raise ConfigError(f"no method to run (task.methods: {list(t.methods)}, task.run_methods: {chosen_labels}); "
                          f"name at least one, e.g. task.run_methods=[linear]")
    set_threads(t.get("threads", "auto"), device, "task.threads")
    limit = memory_limit(t.get("memory_limit_gb"))
    publishing = {"task": "throughput", "publish": t.get("publish"), "publish_replace": bool(t.get("publish_replace"))}
    jobs = [(s, label, b) for s in sizes for label in methods for b in batches]
    if not in_multirun():  # the publish folder must take these rows: asked before the first generation
        check_publish([{**publishing, "size": s, "method": label, "attention": methods[label][0], "batch": b,
                        "seed": cfg.seed} for s, label, b in jobs], RAW_NAME)
    out, meta, rows = run_dir(cfg), provenance(device), []
    for size, label, batch in tqdm(jobs, desc="throughput", unit="run"):
        att_name, mode, att_cfg, settings, backend, graph = methods[label]
        att_cfg = att_cfg.copy()
        chosen = {key: value[size] if OmegaConf.is_dict(value) else value  # per size: {mnist: 29, ...}
                  for key, value in settings.items()}
        for key, value in chosen.items():
            att_cfg[key] = value
        torch.manual_seed(cfg.seed)
        with building_from_config():
            model = PixelTransformer(instantiate(att_cfg), n_mixtures=t.n_mixtures, n_layers=LAYERS[size],
                                     d_model=cfg.model.d_model, n_heads=cfg.model.n_heads, d_ff=cfg.model.d_ff,
                                     dropout=0.0, activation=cfg.model.activation,
                                     norm_first=cfg.model.norm_first)
        model = model.to(device=device, dtype=dtype).eval()
        length = int(np.prod(IMAGE_SHAPES[size]))
        kernel = kernel_fields(model, mode, backend, batch, length, dtype, device, graph)
        note_fallback(label, kernel)
        # past the limit: refused before allocating, or an allocation fails inside the cap (an 'oom'
        # row and the next method, never the operating system's OOM killer)
        result = over_limit(needed_bytes(model, mode, batch, length), limit, f"{label} at batch {batch}")
        try:
            if result is None:
                _warm_up(model, mode, device)
                with memory_cap(limit, device):
                    result = _measure(model, mode, backend, t, length, batch, device, graph)
        except (RuntimeError, MemoryError) as err:
            if (reason := out_of_memory(err)) is None:
                raise
            result = {"status": "oom", "reason": reason}
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if result["status"] == "oom":
            tqdm.write(f"{label} ({size}, batch {batch}): oom: {result['reason']}", file=sys.stderr)
        rows.append({"task": "throughput", "size": size, "method": label, "attention": att_name, "mode": mode,
                     "attention_settings": chosen, "batch": batch, "length": length, "n_layers": LAYERS[size],
                     "dtype": t.dtype, "device_type": device.type,
                     "threads": torch.get_num_threads(), "seed": cfg.seed, **result, **kernel, **meta, **publishing})
        write_jsonl(out / "results.jsonl", rows)
    return aggregate(rows, out, publish=not in_multirun())


def _warm_up(model, mode, device):
    """Three tokens of one image outside the memory cap, so that the generation's lazy imports
    happen here (an import failing half-way under the cap would break its module)."""
    if mode != "floor":
        with contextlib.suppress(NotImplementedError):  # no recurrent form: _measure says so
            generate(model, torch.zeros(1, 1, dtype=torch.long, device=device), 3, dmol.sample, mode=mode)


def _measure(model, mode, backend, t, length, batch, device, graph=False) -> dict:
    """One method at one size and batch: its row's metrics (status ok or error)."""
    graphed = None
    try:
        extra = ({"compile": backend, "compile_s": compile_generation(model, backend, length, batch, device)}
                 if backend else {})
        if graph:  # captured on a short generation, before timing
            watch, graphed = timing.Stopwatch(device), GraphedSteps(model, dmol.sample)
            generate(model, torch.zeros(batch, 1, dtype=torch.long, device=device), min(length, 9), dmol.sample,
                     graphed=graphed)
            extra.update(graph=True, graph_s=watch.wall())
        load = os.getloadavg()[0]
        if mode == "floor":
            total, measured, extrapolated, cpu, extra["weights_gb_per_s"] = time_floor(model, length, batch, device)
        else:
            # a compiled step must not recompile (or fall back to eager) while it is timed
            with torch.compiler.set_stance("fail_on_recompile") if backend else contextlib.nullcontext():
                total, measured, extrapolated, cpu = time_generation(model, length, batch, mode, t.time_budget_s,
                                                                      device, t.probes, graphed)
        return {"status": "ok", **extra, "seconds": total, "seconds_per_image": total / batch,
                "images_per_s": batch / total, "cpu_seconds_per_image": cpu / batch,
                "positions_measured": measured, "extrapolated": extrapolated,
                "loadavg_1min_start": load, "loadavg_1min_end": os.getloadavg()[0]}
    except NotImplementedError as err:  # no recurrent form
        return {"status": "error", "reason": str(err)}
    except ValueError as err:  # a state one graph cannot replay (GraphedSteps says why)
        if graphed is None:
            raise
        return {"status": "error", "reason": str(err)}
    except torch._dynamo.exc.BackendCompilerFailed as err:  # e.g. inductor without a C++ compiler
        cause = getattr(err, "inner_exception", err)
        if (reason := out_of_memory(cause)) is not None:
            return {"status": "oom", "reason": reason}
        return {"status": "error", "reason": f"compile={backend}: {type(cause).__name__}: {cause}".splitlines()[0]}
    except RuntimeError as err:  # a step CUDA cannot capture: this method's row, not the whole run
        if graphed is None or out_of_memory(err) is not None:
            raise
        return {"status": "error", "reason": f"graph=true: {type(err).__name__}: {err}".splitlines()[0]}


def _spread(values) -> str:
    """One run's value, or several runs' range with their count."""
    lo, hi = values.min(), values.max()
    return f"{lo:.3g}" if len(values) == 1 else f"{lo:.3g}-{hi:.3g} ({len(values)} runs)"


def aggregate(rows, out_dir, publish: bool = True) -> float:
    """throughput.csv and throughput.txt (the tables, with the kernel each method ran on) in out_dir
    and, through the guarded publish_folder, in the rows' publish folder (publish=False: out_dir
    alone, as a sweep's job does)."""
    targets = output_dirs(rows, out_dir, RAW_NAME) if publish else [Path(out_dir)]  # refused before any write
    df = pd.DataFrame([r for r in rows if r["status"] == "ok"])
    lines = []
    if df.empty:  # every method failed (oom, error): the reasons below are the table
        df = pd.DataFrame(columns=["size", "method", "seconds_per_image"])
    device_is_cpu = "cpu_seconds_per_image" in df and (df.get("device_type", pd.Series(["cpu"])) == "cpu").all()
    for size, g in df.groupby("size", sort=False):
        table = []
        for method, m in g.groupby("method", sort=False):
            row = {"method": method}
            for batch, rb in m.groupby("batch"):  # several rows: runs of one command published together
                mark = " (extrapolated)" if rb.extrapolated.any() else ""

                row[f"s/image @{batch}"] = _spread(rb.seconds_per_image) + mark
                row[f"images/s @{batch}"] = _spread(rb.images_per_s)
                if device_is_cpu and rb.cpu_seconds_per_image.notna().all():
                    row[f"CPU-time s/image @{batch}"] = _spread(rb.cpu_seconds_per_image)
            b1 = m[m.batch == m.batch.min()].seconds_per_image.median()
            if (m["mode"] == "floor").all():
                row[f"weights GB/s @{m.batch.min()}"] = f"{m.sort_values('batch').weights_gb_per_s.iloc[0]:.3g}"
            else:
                # against every softmax row: re-run, cache, and the cache compiled (compiled
                # methods are compared like for like there)
                for ref in g[g.attention == "softmax"].method.unique():
                    base = g[(g.method == ref) & (g.batch == m.batch.min())]
                    if len(base) and method != ref:
                        row[f"speed-up vs {ref}"] = f"{base.seconds_per_image.median() / b1:.3g}x"  # (medians)
                        if device_is_cpu:  # the same ratio in CPU time (robust to a shared machine's load)
                            c1 = m[m.batch == m.batch.min()].cpu_seconds_per_image.median()
                            row[f"CPU-time speed-up vs {ref}"] = f"{base.cpu_seconds_per_image.median() / c1:.3g}x"
                floor = g[(g["mode"] == "floor") & (g.batch == m.batch.min())]
                if len(floor):  # how far above the cost of reading the weights
                    row[f"x floor @{m.batch.min()}"] = f"{b1 / floor.seconds_per_image.median():.3g}"
                if "compile" in m and isinstance(m["compile"].iloc[0], str):
                    row["compile s"] = f"{m.compile_s.max():.3g}"
                if "graph_s" in m and m.graph_s.notna().any():
                    row["graph capture s"] = f"{m.graph_s.max():.3g}"
            row["paper CPU s/image @1"] = paper.paper_cpu_seconds_per_image(size, method) or ""
            if "kernel_backend" in m and isinstance(m.kernel_backend.iloc[0], str):
                row["kernel"] = m.kernel_backend.iloc[0]
            table.append(row)
        lines += [f"{size} ({int(g.length.iloc[0])} values, {int(g.n_layers.iloc[0])} layers, "
                  f"{g.dtype.iloc[0]}, {g.device.iloc[0]})", pd.DataFrame(table).fillna("").to_string(index=False), ""]
    lines += [f"{r['method']} ({r['size']}, batch {r['batch']}): not measured: {r['reason']}"
              for r in rows if r["status"] != "ok"]
    kernels = {(r["method"], r.get("kernel_backend"), r.get("kernel_backend_why")) for r in rows
               if r.get("kernel_backend")}
    lines += [f"{method}: kernel {name} ({why})" for method, name, why in sorted(kernels, key=str)]
    text = "\n".join(lines)
    print(text)
    for d in targets:
        atomic_write(d / "throughput.csv", rows_to_csv(rows))
        atomic_write(d / "throughput.txt", text)
    lin = df[(df.method == "linear")].seconds_per_image
    return float(lin.min()) if len(lin) else float("nan")
