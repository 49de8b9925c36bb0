"""Speech recognition with linear attention's successors as the transformer encoder's attention:
validation PER and seconds per epoch beside softmax and linear (asr/successors_cpu)."""
import pandas as pd

from repro.reproduction.report.format import hardware, md_table, run_rows
from repro.reproduction.report.schema import Table
from repro.reproduction.report.speech import is_timing_run, seconds_per_epoch_text
from repro.reproduction.report.successors.runs import checked, loaded_by, not_yet_run, source, status_of, with_mark

ENCODERS = ("softmax", "linear", "retention", "gla", "delta")
FOLDER = "asr/successors_cpu"  # where its preset publishes
ASR = Table("asr_table.csv", {"model": str, "steps": float, "valid_per_%": float, "s_per_epoch": float,
                              "status": str}, {"cpu_s_per_epoch": float})


def speech(ctx) -> str:
    out = ["### Speech recognition: phoneme error rate and seconds per epoch"]
    folder, df = checked(ctx, "speech", "asr_table.csv", ASR)
    if df is None:
        return "\n\n".join(out + [not_yet_run(FOLDER)])
    runs = run_rows(folder)
    timing = is_timing_run(df, folder)
    loaded = loaded_by(runs, "model")
    table = []
    for name in ENCODERS:
        found = df[df.model.astype(str) == name]
        if not len(found):
            table.append([name, "not run", None, None])
            continue
        r = found.iloc[-1]
        lost = status_of(r.status)
        per = lost or ("timing run" if timing else None if pd.isna(r["valid_per_%"]) else float(r["valid_per_%"]))
        wall, cpu = (None, None) if lost else (seconds_per_epoch_text(r, "s_per_epoch", r.steps),
                                               seconds_per_epoch_text(r, "cpu_s_per_epoch", r.steps))
        table.append([name, per, with_mark(wall, loaded.get(name, False)) if wall else wall, cpu])
    first = next((r for r in runs if r.get("kind") == "summary"), {})
    setup = (f"{first.get('data', '?')}: {first.get('n_train', '?')} train / {first.get('n_valid', '?')} valid "
             f"utterances, {first.get('model_n_layers', '?')} layers, d_model {first.get('model_d_model', '?')}, "
             f"batch {first.get('batch_size', '?')}") if first else "not recorded"
    out.append(f"Hardware: {hardware(df if 'device' in df else pd.DataFrame(runs))}  \n"
               f"Command: {source(folder, ctx.root)}  \nSetup: {setup}; validation PER (greedy); seconds per epoch "
               "are the median update times the updates of one epoch, \"(from N updates)\" the updates timed; "
               "wall-clock and this process's CPU time" + ("; a timing run: its PER is no result" if timing else ""))
    out.append(md_table(["encoder", "PER %", "s/epoch, wall", "s/epoch, CPU time"], table))
    return "\n\n".join(out)
