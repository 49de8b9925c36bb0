"""task=asr: the paper's Table 3. CTC phoneme recognition from 40-dim log-mel filterbanks with
a non-causal transformer (any attention) or the Bi-LSTM baseline, on the generated read-speech
corpus (repro.data.speech) or a real corpus (LibriSpeech layout, Kaldi data dir).

One run trains one encoder through the shared loop (repro.training.fit); every evaluation
greedily decodes the whole validation set and reports its phoneme error rate (`per`, which a
ReduceLROnPlateau schedule follows). At the end the validation, test and (when present) the
real pocketsphinx utterances are decoded greedily and with torchaudio's beam search, and time
per epoch is steps per epoch x the median step time. A multirun over encoder=... ends in
aggregate(): the Table 3 rows (PER %, seconds per epoch, speed ratio against softmax).
"""
import statistics
from pathlib import Path

import jiwer
import pandas as pd
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from repro.common import paper
from repro.common.errors import ConfigError, building_from_config
from repro.common.results import REPO, atomic_write, output_dirs, provenance, save_figure
from repro.conf import in_multirun
from repro.conf import run_dir as get_run_dir
from repro.conf.attention import attention_name
from repro.data.features import BucketedBatches, LogMelFilterbank, SpeechDataset, eval_batches, spec_augment
from repro.data.speech import (
    BLANK,
    PHONEMES,
    CorpusSettings,
    espeak_summary,
    espeak_text,
    generate,
    load_kaldi,
    load_librispeech,
    load_manifest,
    load_pocketsphinx,
)
from repro.training import fit, seed_everything
from repro.training.distributed import is_main
from repro.training.loop import parse_device, step_time_text, to_device
from repro.training.rows import append_row, read_rows

N_LABELS = len(PHONEMES) + 1  # blank + 39 phonemes
SOURCES = ("tts", "librispeech", "kaldi")
PAPER = paper.ASR  # Table 3: {model: (validation PER %, seconds per epoch)}


def ctc_loss(model, batch):
    log_probs, lengths = model(batch["features"], batch["lengths"])             # (B, T', C)
    loss = F.ctc_loss(log_probs.transpose(0, 1), batch["labels"], lengths, batch["label_lengths"],
                      blank=BLANK, reduction="mean", zero_infinity=True)
    return loss, {}


def greedy_decode(log_probs, lengths) -> list[list[int]]:
    """Best label per frame, repeats merged, then blanks dropped (the CTC collapse rule)."""
    best = log_probs.argmax(-1)                                                  # (B, T)
    out = []
    for b, n in zip(best.tolist(), lengths.tolist()):
        path = b[:n]
        out.append([c for i, c in enumerate(path) if c != BLANK and (i == 0 or c != path[i - 1])])
    return out


def beam_decoder(beam_size: int):
    """torchaudio's lexicon-free CTC beam search (flashlight-text). Its token list needs a word
    separator: "|" is appended as a label the model never emits."""
    from torchaudio.models.decoder import ctc_decoder

    return ctc_decoder(lexicon=None, tokens=["-", *PHONEMES, "|"], lm=None, beam_size=beam_size,
                       blank_token="-", sil_token="|")


def beam_decode(decoder, log_probs, lengths) -> list[list[int]]:
    emissions = torch.cat([log_probs.float().cpu(), torch.full((*log_probs.shape[:2], 1), -1e4)], -1).contiguous()
    hyps = decoder(emissions, lengths.cpu().to(torch.int32))
    return [[t for t in h[0].tokens.tolist() if 0 < t <= len(PHONEMES)] for h in hyps]


def phoneme_string(ids) -> str:
    return " ".join(PHONEMES[i - 1] for i in ids)


def per(hypotheses, references) -> float:
    """Phoneme error rate: jiwer's word error rate over phoneme tokens (substitutions +
    deletions + insertions over reference phonemes)."""
    return float(jiwer.wer([phoneme_string(r) for r in references], [phoneme_string(h) for h in hypotheses]))


def hypothesis_rows(split, refs, greedy, beam=None) -> list[dict]:
    """One row per utterance: the reference and the decoded phonemes with their own PER (for
    hypotheses.csv, which wandb also receives as a table)."""
    rows = []
    for i, (r, g) in enumerate(zip(refs, greedy)):
        row = {"split": split, "utterance": i, "reference": phoneme_string(r), "greedy": phoneme_string(g),
               "per_greedy": per([g], [r]) if r else float("nan")}
        if beam:
            row.update(beam=phoneme_string(beam[i]), per_beam=per([beam[i]], [r]) if r else float("nan"))
        rows.append(row)
    return rows


def decode_set(model, batches, device, decoder=None, keep=False) -> dict:
    """PER of the set (greedy, and beam search with a decoder); keep=True also returns the
    per-utterance rows under "utterances"."""
    greedy, beam, refs = [], [], []
    for batch in batches:
        batch = to_device(batch, device)
        log_probs, lengths = model(batch["features"], batch["lengths"])
        greedy += greedy_decode(log_probs, lengths)
        if decoder is not None:
            beam += beam_decode(decoder, log_probs, lengths)
        refs += [lab[:n].tolist() for lab, n in zip(batch["labels"], batch["label_lengths"])]
    out = {"per": per(greedy, refs), "n_utts": len(refs)}
    if decoder is not None:
        out["per_beam"] = per(beam, refs)
    if keep:
        out["utterances"] = hypothesis_rows(None, refs, greedy, beam)
    return out


def _rows(t, cfg):
    """train / valid / test utterance rows, and a description of the data."""
    if t.source not in SOURCES:
        raise ConfigError(f"task.source={t.source!r}; valid: {', '.join(SOURCES)}")
    if t.source == "tts":
        settings = CorpusSettings(**OmegaConf.to_container(t.corpus, resolve=True))
        folder = generate(settings, root=REPO / t.data_dir if t.get("data_dir") else None,
                          progress=cfg.trainer.progress)
        rows = load_manifest(folder)
        split = {s: [r for r in rows if r["split"] == s] for s in ("train", "valid", "test")}
        return split, f"tts:{folder.name}"
    load = load_librispeech if t.source == "librispeech" else load_kaldi
    split = {}
    for s in ("train", "valid", "test"):
        d = t.get(f"{s}_dir")
        if d is None and s != "test":
            raise ConfigError(f"task.source={t.source} needs task.{s}_dir")
        split[s] = load(d, s) if d is not None else []
    return split, f"{t.source}:{t.train_dir}"


def run(cfg) -> float:
    t, m = cfg.task, cfg.model
    run_dir = get_run_dir(cfg)
    seed_everything(cfg.seed)
    if m.get("encoder") not in ("transformer", "bilstm") or m.encoder not in m:
        raise ConfigError(f"model.encoder={m.get('encoder')!r}; task=asr needs model=wsj (or wsj_tiny) and "
                          f"encoder=bilstm|softmax|lsh-4|linear, or model.encoder=transformer|bilstm")
    name = "bilstm" if m.encoder == "bilstm" else attention_name(cfg)
    splits, data_id = _rows(t, cfg)
    f = t.features
    fbank = LogMelFilterbank(f.n_mels, kind=f.kind)
    train = SpeechDataset(splits["train"], fbank, f.norm,
                          spec_augment=spec_augment(f.freq_mask, f.time_mask, f.n_masks), progress=cfg.trainer.progress)
    stats = train.stats if f.norm == "global" else None
    valid = SpeechDataset(splits["valid"], fbank, f.norm, stats)
    test = SpeechDataset(splits["test"], fbank, f.norm, stats) if splits["test"] else None
    real_rows = (load_pocketsphinx(t.real_test) if t.source == "tts" and t.real_test and Path(t.real_test).is_dir()
                 else [])
    real = SpeechDataset(real_rows, fbank, f.norm, stats) if real_rows else None
    if not len(valid):
        raise ConfigError("task: the validation set is empty")
    # words CMUdict lacks took espeak-ng's pronunciation: say how many, in the printout and every row
    lexicon_rows = [r for rows in (*splits.values(), real_rows) for r in rows if "espeak_words" in r]
    lexicon = espeak_summary(lexicon_rows) if lexicon_rows else {}
    print(f"asr data {data_id}: {len(train)} train / {len(valid)} valid / {len(test) if test else 0} test"
          + (f" / {len(real)} real" if real else "") + " utterances"
          + (f"; transcripts: {espeak_text(lexicon)}" if lexicon else ""))
    data = BucketedBatches(train, t.batch_size, seed=cfg.seed)
    valid_batches = eval_batches(valid, t.eval_batch_size)

    with building_from_config():
        attention = instantiate(cfg.attention) if m.encoder == "transformer" else None
        model = instantiate(m[m.encoder], attention=attention, n_labels=N_LABELS, n_features=f.n_mels)
    device = parse_device(cfg.device)
    frames = train.lengths()
    enc = OmegaConf.to_container(m[m.encoder], resolve=True)
    enc.pop("_target_")
    identity = {"task": "asr", "model": name, "encoder": m.encoder,
                "attention": name if m.encoder == "transformer" else None, "seed": cfg.seed, "data": data_id,
                "n_train": len(train), "n_valid": len(valid),
                "n_test": len(test) if test else 0, "mean_frames": statistics.mean(frames), "max_frames": max(frames),
                "batch_size": t.batch_size, "steps_per_epoch": len(data), "max_steps": cfg.trainer.max_steps,
                "optimizer": cfg.trainer.optimizer._target_, "lr": cfg.trainer.optimizer.lr,
                **{f"model_{k}": v for k, v in enc.items()}, **lexicon, "label": t.label, "publish": t.publish,
                "publish_replace": bool(t.get("publish_replace"))}

    def hook(model, step):
        return {"per": decode_set(model, valid_batches, device)["per"]}

    final = fit(model, ctc_loss, data, cfg, run_dir=run_dir, eval_data=lambda: valid_batches, identity=identity,
                eval_hook=hook)
    # the trained model on every held-out set, greedy and beam search
    model.eval()
    decoder = beam_decoder(t.beam_size) if t.beam_size else None
    summary = {"status": final["status"], "steps": final["steps"], "train_loss": final["train_loss"],
               "time_per_step_ms": final["time_per_step_ms"], "n_params": final["n_params"],
               "time_per_epoch_s": (final["time_per_step_ms"] or float("nan")) * len(data) / 1e3,
               "cpu_time_per_epoch_s": (final["cpu_time_per_step_ms"] or float("nan")) * len(data) / 1e3,
               "epochs": final["steps"] / len(data),
               **{k: final.get(k) for k in ("loadavg_1min_start", "loadavg_1min_end")}}
    utterances = []
    with torch.no_grad():
        for split, ds in [("valid", valid), ("test", test), ("real", real)]:
            if ds is not None and final["steps"]:
                batches = valid_batches if ds is valid else eval_batches(ds, t.eval_batch_size)
                r = decode_set(model, batches, device, decoder, keep=True)
                utterances += [{**u, "split": split} for u in r.pop("utterances")]
                summary.update({f"{split}_{k}": v for k, v in r.items()})
    if is_main():  # under DDP every rank decoded; rank 0 writes, as fit does
        if utterances:  # hypotheses against references, per utterance (to wandb as a table with logger=wandb)
            atomic_write(run_dir / "hypotheses.csv", pd.DataFrame(utterances).to_csv(index=False))
        rows = read_rows(run_dir / "results.jsonl")
        rows.append({**identity, "precision": cfg.trainer.precision, "kind": "summary", **summary,
                     **provenance(device)})
        append_row(run_dir / "results.jsonl", rows[-1])
    print(f"asr {name}: {summary['status']}, {summary['steps']} steps ({summary['epochs']:.1f} epochs), valid PER "
          f"{100 * summary.get('valid_per', float('nan')):.1f}% "
          f"(beam {100 * summary.get('valid_per_beam', float('nan')):.1f}%), "
          f"test PER {100 * summary.get('test_per', float('nan')):.1f}%, "
          + (f"{summary['time_per_epoch_s']:.1f} s/epoch (median step x steps per epoch), "
             if final["time_per_step_ms"] else "")
          + step_time_text(final))
    if is_main() and not in_multirun():
        aggregate(rows, run_dir)
    return float(summary.get("valid_per", float("nan")))


# ----------------------------------------------------------------------------- aggregation

def table(df) -> pd.DataFrame:
    """Table 3: one row per model (mean over seeds)."""
    s = df[df.kind == "summary"]
    cols = [c for c in ("valid_per", "valid_per_beam", "test_per", "test_per_beam", "real_per", "real_per_beam")
            if c in s]
    g = s.groupby("model", sort=False)
    out = pd.DataFrame({"seeds": g.seed.nunique(), "steps": g.steps.max(), "epochs": g.epochs.mean(),
                        **{f"{c}_%": 100 * g[c].mean() for c in cols},
                        "s_per_epoch": g.time_per_epoch_s.mean(), "cpu_s_per_epoch": g.cpu_time_per_epoch_s.mean(),
                        "ms_per_step": g.time_per_step_ms.mean(), "n_params": g.n_params.first(),
                        "mean_frames": g.mean_frames.first(),
                        "status": g.status.agg(lambda v: ",".join(sorted(set(v))))}).reset_index()
    order = {k: i for i, k in enumerate(PAPER)}
    out = out.sort_values("model", key=lambda c: c.map(lambda v: order.get(v, len(order)))).reset_index(drop=True)
    if "softmax" in set(out.model):
        ref = out.set_index("model")
        out["speed_vs_softmax"] = ref.loc["softmax", "s_per_epoch"] / out.s_per_epoch
    out["paper_per_%"] = out.model.map(lambda v: PAPER.get(v, (None, None))[0])
    out["paper_s_per_epoch"] = out.model.map(lambda v: PAPER.get(v, (None, None))[1])
    return out


def _title(df) -> str:
    r = df[df.kind == "summary"].iloc[0]
    label = f"{r['label']} | " if r.get("label") else ""
    return (f"{label}CTC phoneme recognition, {r['data']}: {r['n_train']} train / {r['n_valid']} valid / "
            f"{r['n_test']} test utterances,\n"
            f"mean {r['mean_frames']:.0f} frames (max {r['max_frames']}), batch {r['batch_size']}, "
            f"{r['steps_per_epoch']} steps/epoch, {r['precision']}\n{r['device']}"
            + (f"\ntranscripts: {espeak_text(r)}" if pd.notna(r.get("n_espeak_words")) else ""))


def plot(df, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ev = df[(df.kind == "eval") & df.get("per", pd.Series(dtype=float)).notna()]
    for name, g in ev.groupby("model", sort=False):
        m = g.groupby("step").per.mean()
        ax.plot(m.index / g.steps_per_epoch.iloc[0], 100 * m.values, marker="o", ms=3, label=name)
    ax.set_xlabel("epochs")
    ax.set_ylabel("validation PER % (greedy)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(_title(df), fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def aggregate(rows, out_dir) -> pd.DataFrame:
    """asr_table.csv, table.txt and asr_per.png (validation PER against epochs); rows carrying
    a `publish` folder are written there too, with the raw rows."""
    df = pd.DataFrame(rows)
    if not (df.kind == "summary").any():
        return pd.DataFrame()
    tab = table(df)
    text = f"{_title(df)}\n\n" + tab.to_string(index=False, float_format=lambda v: f"{v:.4g}")
    if "speed_vs_softmax" in tab and "linear" in set(tab.model):
        ratio = float(tab.set_index("model").loc["linear", "speed_vs_softmax"])
        s = df[(df.kind == "summary") & (df.model == "linear")].iloc[0]
        sub = s.get("model_subsample", 1) or 1
        text += (f"\n\nlinear vs softmax, time per epoch: linear is {ratio:.2f}x as fast, at a mean of "
                 f"{tab.mean_frames.iloc[0]:.0f} frames ({tab.mean_frames.iloc[0] / sub:.0f} encoder positions after "
                 f"x{sub} subsampling); the paper: 3.3x at about 800 frames, on a GPU")
    print(text)
    for d in output_dirs(rows, out_dir, "asr_rows.jsonl"):
        atomic_write(d / "asr_table.csv", tab.to_csv(index=False))
        atomic_write(d / "table.txt", text + "\n")
        if "per" in df and df.per.notna().any():  # a timing run (eval_every=0) has no curve
            plot(df, d / "asr_per.png")
    return tab
