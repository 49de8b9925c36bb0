"""task=norms, docs/extending.md's example task: the output norm of one attention layer on random
input at a few lengths; a row per length, and a table over a sweep's rows. Copied to
repro/tasks/norms.py by tests/test_extending.py."""
import pandas as pd
import torch
from hydra.utils import instantiate

from repro.common.config import parse_device
from repro.common.results import atomic_write, output_dirs, provenance, rows_to_csv, write_jsonl
from repro.conf import in_multirun, run_dir
from repro.conf.attention import attention_name


def run(cfg) -> float:
    t, device = cfg.task, parse_device(cfg.device)
    torch.manual_seed(cfg.seed)
    layer = instantiate(cfg.attention)(d_model=cfg.model.d_model, n_heads=cfg.model.n_heads).to(device)
    rows = []
    for n in t.lengths:
        with torch.no_grad():
            y = layer(torch.randn(1, n, cfg.model.d_model, device=device), causal=t.causal)  # (1, N, d_model)
        rows.append({"task": "norms", "publish": t.publish, "attention": attention_name(cfg), "n": n,
                     "seed": cfg.seed, "status": "ok", "output_norm": float(y.norm()) / n ** 0.5,
                     **provenance(device)})
    out = run_dir(cfg)
    write_jsonl(out / "results.jsonl", rows)  # the sweep's callback reads these
    return rows[-1]["output_norm"] if in_multirun() else aggregate(rows, out)


def aggregate(rows, out_dir) -> float:
    """norms.csv (in the run or sweep dir, and in the rows' publish folder, through the guarded
    output_dirs: the rows beside it as norms_rows.jsonl) and a printed table."""
    df = pd.DataFrame(rows)
    print(df.pivot_table(index="n", columns="attention", values="output_norm").to_string())
    for folder in output_dirs(rows, out_dir, "norms_rows.jsonl"):
        atomic_write(folder / "norms.csv", rows_to_csv(rows))
    return float(df.output_norm.mean())
