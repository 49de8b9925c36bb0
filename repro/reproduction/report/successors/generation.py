"""Image generation with linear attention's successors: MNIST bits/dim (one seed per attention:
a measurement) and the speed of generating with each recurrent twin beside linear and softmax
with a key/value cache (stateful softmax), at batch 1 and 64."""
import pandas as pd

from repro.reproduction.report import marks
from repro.reproduction.report.format import dataset_of, hardware, md_table, num, run_rows
from repro.reproduction.report.schema import Table
from repro.reproduction.report.successors.runs import checked, loaded_by, not_yet_run, source, status_of, with_mark

ATTENTIONS = ("softmax", "linear", "retention", "gla", "delta")
METHODS = ("linear", "stateful-softmax", "retention", "gla", "delta")
BASELINE = "stateful-softmax"
SMALL, LARGE = 1, 64  # the batches of throughput_successors_cpu: seconds per image at 1, images/s at 64
MNIST, SPEED = "images/successors_cpu", "throughput/successors_cpu"  # where their presets publish
BPD = Table("bpd_final.csv", {"attention": str, "n_seeds": float, "steps": float, "eval_bits_per_dim": float,
                              "train_loss_nats": float, "time_per_step_ms": float, "status": str})
THROUGHPUT = Table("throughput.csv", {"size": str, "method": str, "batch": float, "images_per_s": float,
                                      "seconds_per_image": float, "status": str, "device": str})


def mnist(ctx) -> str:
    out = ["### MNIST: bits/dim"]
    folder, df = checked(ctx, "mnist", "bpd_final.csv", BPD)
    if df is None:
        return "\n\n".join(out + [not_yet_run(MNIST)])
    runs = run_rows(folder)
    finals = [r for r in runs if r.get("kind") == "final"]
    loaded = loaded_by(runs, "attention")
    table = []
    for att in ATTENTIONS:
        found = df[df.attention.astype(str) == att]
        if not len(found):
            table.append([att, "not run", None, None, None, None])
            continue
        r = found.iloc[-1]
        lost = status_of(r.status)
        seeds = int(r.n_seeds) if pd.notna(r.n_seeds) else None
        table.append([att, lost or num(float(r.eval_bits_per_dim)), None if lost else float(r.train_loss_nats),
                      None if lost or pd.isna(r.time_per_step_ms) else with_mark(num(float(r.time_per_step_ms)),
                                                                                loaded.get(att, False)),
                      f"{int(r.steps):,}" if pd.notna(r.steps) else None, seeds])
    first = finals[0] if finals else {}
    shape = "x".join(map(str, first.get("image_shape", [])[1:])) or "?"
    setup = (f"{first.get('dataset', 'mnist')} {shape}, {first.get('n_layers', '?')} layers, d_model "
             f"{first.get('d_model', '?')}, batch {first.get('batch_size', '?')}" if first else "not recorded")
    many = df.n_seeds.max() > 1 if len(df) else False
    out.append(f"Hardware: {hardware(pd.DataFrame(finals))}  \nCommand: {source(folder, ctx.root)}  \n"
               f"Setup: {setup}; held-out bits/dim at the end of training, "
               + ("the mean over the seeds shown (a measurement: the claims judge bits/dim from "
                  "images/mnist_claims_seeds_cpu)" if many else
                  "one seed per attention: a measurement, not judged (the seeds' spread at these sizes is in "
                  "images/mnist_claims_seeds_cpu)") + "; ms/step wall-clock")
    out.append(md_table(["attention", "held-out bits/dim", "train loss (nats)", "ms/step", "updates", "seeds"],
                        table))
    if (folder / "bpd_curves.png").is_file():
        out.append(f"![bits/dim against updates, {folder.relative_to(ctx.root)}]({ctx.rel(folder / 'bpd_curves.png')})")
    return "\n\n".join(out)


def _speedup(r, base, column, faster_is_larger: bool) -> str | None:
    """How many times faster than stateful softmax, marked as its two values are."""
    if r is None or base is None or status_of(r.status) or status_of(base.status):
        return None
    a, b = float(r[column]), float(base[column])
    if not (a > 0 and b > 0):
        return None
    on = [m for m, is_on in (("extrapolated", marks.extrapolated(r) or marks.extrapolated(base)),
                             ("loaded", marks.loaded(r) or marks.loaded(base))) if is_on]
    return f"{(a / b if faster_is_larger else b / a):.3g}x" + (f" ({', '.join(on)})" if on else "")


def _value(r, column) -> str | None:
    if r is None:
        return "not in this run"
    return status_of(r.status) or (marks.marked(r[column], r) if pd.notna(r[column]) else "not measured")


def speed(ctx) -> str:
    out = ["### Generation speed: seconds per image and images per second"]
    folder, df = checked(ctx, "speed", "throughput.csv", THROUGHPUT)
    if df is None:
        return "\n\n".join(out + [not_yet_run(SPEED)])
    mnist_rows = df[df["size"].map(dataset_of) == "mnist"]
    # a repeated (method, batch): the last row, the run that wrote the file last
    at = {(str(r.method), int(r.batch)): r for _, r in mnist_rows.iterrows()}
    table = []
    for method in METHODS:
        small, large = at.get((method, SMALL)), at.get((method, LARGE))
        table.append([method, _value(small, "seconds_per_image"),
                      "1x" if method == BASELINE and small is not None else
                      _speedup(small, at.get((BASELINE, SMALL)), "seconds_per_image", False),
                      _value(large, "images_per_s"),
                      "1x" if method == BASELINE and large is not None else
                      _speedup(large, at.get((BASELINE, LARGE)), "images_per_s", True)])
    first = mnist_rows.iloc[0] if len(mnist_rows) else None
    # first["dtype"], never first.dtype: that is the row's own pandas dtype
    setup = ("MNIST-sized model (784 values" + (f", {int(first['n_layers'])} layers" if "n_layers" in df else "")
             + ", untrained), sampled pixel by pixel with each attention's recurrent form"
             + (f", {first['dtype']}" if "dtype" in df else "")
             + (f", {int(first['threads'])} torch thread(s)" if "threads" in df and pd.notna(first["threads"]) else "")
             ) if first is not None else "no MNIST rows"
    out.append(f"Hardware: {hardware(mnist_rows)}  \nCommand: {source(folder, ctx.root)}  \n"
               f"Setup: {setup}; (extrapolated): a generation stopped at its time budget and its total "
               "extrapolated; (loaded): the machine's 1-minute load passed its cores during the run")
    out.append(md_table(["method", f"s/image, batch {SMALL}", f"speed-up vs stateful softmax, batch {SMALL}",
                         f"images/s, batch {LARGE}", f"speed-up vs stateful softmax, batch {LARGE}"], table))
    return "\n\n".join(out)
