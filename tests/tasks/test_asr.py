"""task=asr: the generated corpus, real-corpus loaders, features, encoders, CTC decoding, PER."""
import json
import os

import jiwer
import numpy as np
import pandas as pd
import pytest
import soundfile as sf
import torch
import torchaudio
from hydra.utils import instantiate

from repro.common.errors import ConfigError
from repro.common.results import read_jsonl
from repro.data.features import BucketedBatches, LogMelFilterbank, SpeechDataset, collate
from repro.data.speech import (
    LABELS,
    PHONEMES,
    CorpusSettings,
    espeak_to_arpabet,
    generate,
    load_kaldi,
    load_librispeech,
    load_manifest,
    load_pocketsphinx,
    words_to_arpabet,
)
from repro.data.speech.espeak import engine
from repro.models.ctc import BiLSTMEncoder, CTCTransformer
from repro.tasks.asr import N_LABELS, beam_decode, beam_decoder, ctc_loss, greedy_decode, per

TINY = dict(n_sentences=6, renditions=2, min_words=4, max_words=8, valid_fraction=0.2, test_fraction=0.2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return generate(CorpusSettings(**TINY), root=tmp_path_factory.mktemp("speech"), progress=False)


def test_corpus_is_speech_with_phonemes_and_held_out_splits(corpus):
    rows = load_manifest(corpus)
    assert len(rows) == 4 * 2 + 1 + 1 and json.loads((corpus / "settings.json").read_text())["seed"] == 0
    for r in rows:
        wav, sr = sf.read(r["audio"])
        assert sr == 16000 and len(wav) == r["n_samples"] > 8000
        # speech is far louder than the added noise floor: the loudest 10 ms frame stands far above the quietest
        frames = np.sqrt((wav[: len(wav) // 160 * 160].reshape(-1, 160) ** 2).mean(1))
        assert frames.max() > 0.05 and frames.max() > 4 * frames.min()
        assert r["phonemes"] and set(r["phonemes"]) <= set(PHONEMES) and r["unmapped"] == []
    by = {s: [r for r in rows if r["split"] == s] for s in ("train", "valid", "test")}
    texts = {s: {r["text"] for r in v} for s, v in by.items()}
    assert (not (texts["train"] & texts["valid"]) and not (texts["train"] & texts["test"])
            and not (texts["valid"] & texts["test"]))
    assert ({r["speaker"] for r in by["test"]} == {"en-us+f3"}
            and "en-us+f3" not in {r["speaker"] for r in by["train"] + by["valid"]})


def test_a_damaged_manifest_is_refused_and_a_dead_builds_folder_is_cleared(corpus, tmp_path):
    """A torn last line of manifest.jsonl used to drop an utterance silently, the corpus keeping
    its id; a build killed mid-way left its temporary folder for good."""
    import shutil

    from repro.common.errors import ConfigError

    copy = tmp_path / corpus.name
    shutil.copytree(corpus, copy)
    manifest = copy / "manifest.jsonl"
    text = manifest.read_text()
    manifest.write_text(text[:-10])
    with pytest.raises(ConfigError, match="is damaged \\(its last line is cut off\\)"):
        load_manifest(copy)
    manifest.write_text("".join(text.splitlines(keepends=True)[:-1]))  # one whole line fewer
    with pytest.raises(ConfigError, match="holds 9 utterances, not 10"):
        load_manifest(copy)
    dead = tmp_path / ".tts-0123abcd-999999-x1y2z3"  # a build by a process that no longer runs
    (dead / "audio").mkdir(parents=True)
    alive = tmp_path / f".tts-0123abcd-{os.getpid()}-x1y2z3"  # one still running: left alone
    alive.mkdir()
    generate(CorpusSettings(**{**TINY, "n_sentences": 5}), root=tmp_path, progress=False)
    assert not dead.exists() and alive.exists()


def test_corpus_is_deterministic_and_cached(corpus, tmp_path):
    again = generate(CorpusSettings(**TINY), root=tmp_path, progress=False)
    a, b = load_manifest(corpus), load_manifest(again)
    assert [(r["id"], r["text"], r["phonemes"], r["speaker"], r["rate"]) for r in a] == \
           [(r["id"], r["text"], r["phonemes"], r["speaker"], r["rate"]) for r in b]
    assert [(r["pitch"], r["snr_db"]) for r in a] == [(r["pitch"], r["snr_db"]) for r in b]
    # espeak-ng keeps internal state between calls (a jitter of a few samples): lengths agree closely
    assert all(abs(x["n_samples"] - y["n_samples"]) < 0.01 * x["n_samples"] for x, y in zip(a, b))
    stamp = (again / "manifest.jsonl").stat().st_mtime_ns
    assert generate(CorpusSettings(**TINY), root=tmp_path, progress=False) == again
    assert (again / "manifest.jsonl").stat().st_mtime_ns == stamp
    other = generate(CorpusSettings(**{**TINY, "seed": 1}), root=tmp_path, progress=False)
    assert other != again


@pytest.mark.parametrize("text", ["the cat sat on the mat", "she said that the weather would change by evening",
                                  "numbers are compared by value and strings by character"])
def test_engine_phonemes_agree_with_cmudict(text):
    """The engine's transcription, mapped to ARPAbet, is close to CMUdict's (an independent
    lexicon): the mapping is right up to accent and reduced-vowel choices."""
    mapped, unmapped = espeak_to_arpabet(engine().phonemes(text))
    assert unmapped == [] and per([[LABELS[p] for p in mapped]], [[LABELS[p] for p in words_to_arpabet(text)]]) < 0.3


def test_phoneme_mapping_details():
    assert espeak_to_arpabet(["k", "'3:", "r", "@", "n", "t"])[0] == ["K", "ER", "AH", "N", "T"]
    assert espeak_to_arpabet(["s", "t", "'A@", "", "t"])[0] == ["S", "T", "AA", "R", "T"]
    assert espeak_to_arpabet(["Q9"]) == ([], ["Q9"])
    assert words_to_arpabet("Hello, world!") == ["HH", "AH", "L", "OW", "W", "ER", "L", "D"]
    assert len(PHONEMES) == 39 and N_LABELS == 40


def test_features_match_torchaudio():
    wave = torch.randn(16000 + 1234) * 0.1
    x = LogMelFilterbank(40, kind="kaldi")(wave)
    ref = torchaudio.compliance.kaldi.fbank(wave[None] * 32768, num_mel_bins=40, dither=0.0)
    assert x.shape == (1 + (len(wave) - 400) // 160, 40) and torch.allclose(x, ref)
    m = LogMelFilterbank(40, kind="mel")(wave)
    spec = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=40)(wave)
    assert m.shape == (len(wave) // 160 + 1, 40) and torch.allclose(m, torch.log(spec + 1e-6).T)
    with pytest.raises(ConfigError, match="valid: kaldi, mel"):
        LogMelFilterbank(kind="mfcc")


def test_batches_pad_and_resume(corpus):
    ds = SpeechDataset(load_manifest(corpus), LogMelFilterbank())
    x = ds[0]["features"]
    assert torch.allclose(x.mean(0), torch.zeros(40), atol=1e-4)  # per-utterance normalisation
    batches = BucketedBatches(ds, 3, seed=0)
    b = next(batches)
    n = b["lengths"]
    assert b["features"].shape == (3, int(n.max()), 40)
    assert all((b["features"][i, n[i]:] == 0).all() for i in range(3))
    state = batches.state_dict()
    want = next(batches)["index"]
    again = BucketedBatches(ds, 3, seed=0)
    again.load_state_dict(state)
    assert torch.equal(next(again)["index"], want)


def _alone_vs_padded(model, lengths, n_features=40):
    model.eval()
    feats = [torch.randn(n, n_features) for n in lengths]
    batch = collate([{"features": f, "labels": torch.tensor([1]), "index": i} for i, f in enumerate(feats)])
    with torch.no_grad():
        out, out_len = model(batch["features"], batch["lengths"])
        for i, f in enumerate(feats):
            alone, n = model(f[None], torch.tensor([len(f)]))
            assert out_len[i] == n[0] and alone.shape[1] == n[0]
            torch.testing.assert_close(out[i, :n[0]], alone[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("attention", ["softmax", "linear"])
@pytest.mark.parametrize("subsample", [1, 2])
def test_padding_does_not_change_transformer_outputs(compose_cfg, attention, subsample):
    cfg = compose_cfg("task=asr", f"encoder={attention}")
    model = CTCTransformer(instantiate(cfg.attention), N_LABELS, n_layers=2, d_model=48, n_heads=3, d_ff=64,
                           subsample=subsample)
    _alone_vs_padded(model, [37, 11, 23])


def test_padding_does_not_change_bilstm_outputs():
    _alone_vs_padded(BiLSTMEncoder(N_LABELS, n_layers=2, hidden=24), [29, 7, 16])
    _alone_vs_padded(BiLSTMEncoder(N_LABELS, n_layers=1, hidden=16, subsample=2), [29, 7, 16])


@pytest.mark.slow
def test_ctc_training_lowers_the_loss(corpus):
    torch.manual_seed(0)
    ds = SpeechDataset(load_manifest(corpus), LogMelFilterbank())
    batch = collate([ds[i] for i in range(4)])
    model = CTCTransformer(instantiate({"_target_": "repro.attention.LinearAttention", "_partial_": True}), N_LABELS,
                           n_layers=2, d_model=64, n_heads=4, d_ff=128, dropout=0.0, subsample=2)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss, _ = ctc_loss(model, batch)
        # reference: torch's CTCLoss module on the same log-probabilities
        lp, n = model(batch["features"], batch["lengths"])
        ref = torch.nn.CTCLoss(blank=0, zero_infinity=True)(lp.transpose(0, 1), batch["labels"], n,
                                                             batch["label_lengths"])
        assert torch.allclose(loss, ref)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


def test_per_of_a_known_pair():
    # ref AA B CH D, hyp AA CH D EH: B deleted, EH inserted -> 2 edits / 4 reference phonemes
    ref = [[LABELS[p] for p in ["AA", "B", "CH", "D"]]]
    hyp = [[LABELS[p] for p in ["AA", "CH", "D", "EH"]]]
    assert per(hyp, ref) == pytest.approx(0.5)
    # two utterances pool their edits: (1 substitution + 0) / (3 + 2)
    assert per([[1, 2, 4], [5, 6]], [[1, 2, 3], [5, 6]]) == pytest.approx(1 / 5)


def test_greedy_collapse_rule_and_beam_search():
    path = [[3, 3, 0, 3, 7, 7, 0, 0, 5], [2, 0, 2, 2, 9, 9, 9, 9, 9]]
    lengths = torch.tensor([9, 4])
    lp = torch.log_softmax(torch.nn.functional.one_hot(torch.tensor(path), N_LABELS).float() * 8, -1)
    assert greedy_decode(lp, lengths) == [[3, 3, 7, 5], [2, 2]]
    assert beam_decode(beam_decoder(8), lp, lengths) == [[3, 3, 7, 5], [2, 2]]


def _flac(path, seconds=0.5, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, np.random.default_rng(seed).standard_normal(int(16000 * seconds)) * 0.1, 16000)


def test_librispeech_and_kaldi_loaders(tmp_path):
    root = tmp_path / "libri"
    _flac(root / "19/198/19-198-0001.flac")
    _flac(root / "19/198/19-198-0002.flac", 0.3)
    (root / "19/198/19-198.trans.txt").write_text("19-198-0001 HELLO WORLD\n19-198-0002 THE CAT\n")
    rows = load_librispeech(root)
    assert [r["id"] for r in rows] == ["19-198-0001", "19-198-0002"] and rows[0]["speaker"] == "19"
    assert rows[0]["phonemes"] == ["HH", "AH", "L", "OW", "W", "ER", "L", "D"] and rows[1]["n_samples"] == 4800
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    _flac(kaldi / "a.flac")
    (kaldi / "wav.scp").write_text(f"u1 {kaldi / 'a.flac'}\nu2 a.flac\n")
    (kaldi / "text").write_text("u1 the cat sat\nu2 on the mat\n")
    (kaldi / "utt2spk").write_text("u1 spk1\nu2 spk2\n")
    rows = load_kaldi(kaldi)
    assert ([r["speaker"] for r in rows] == ["spk1", "spk2"]
            and rows[1]["phonemes"] == ["AA", "N", "DH", "AH", "M", "AE", "T"])
    ds = SpeechDataset(rows, LogMelFilterbank())
    assert ds[0]["features"].shape == (1 + (8000 - 400) // 160, 40)


def test_pocketsphinx_loader(tmp_path):
    assert load_pocketsphinx(tmp_path / "absent") == []
    _flac(tmp_path / "cards/001.wav")
    (tmp_path / "cards").mkdir(exist_ok=True)
    (tmp_path / "cards/cards.transcription").write_text("<s> ten of clubs  </s> (001)\n")
    rows = load_pocketsphinx(tmp_path)
    assert rows[0]["id"] == "001" and rows[0]["text"] == "ten of clubs" and rows[0]["phonemes"][:3] == ["T", "EH", "N"]


@pytest.mark.parametrize("case,match", [
    ("no_dir", "does not exist"), ("no_audio", "19-198-0001.flac for utterance"), ("bad_line", "malformed line"),
    ("oov", "'日本' is not in CMUdict and cannot be pronounced"), ("kaldi_pipe", "pipe command"),
    ("kaldi_missing", "wav.scp: missing"), ("corrupt", "unreadable audio")])
def test_loader_errors_are_one_line(tmp_path, case, match):
    root = tmp_path / "c"
    trans = root / "19/198/19-198.trans.txt"
    if case != "no_dir" and not case.startswith("kaldi"):
        trans.parent.mkdir(parents=True)
        lines = {"bad_line": "19-198-0001\n", "oov": "19-198-0001 THE 日本\n"}
        trans.write_text(lines.get(case, "19-198-0001 HELLO\n"))
        if case in ("bad_line", "oov"):
            _flac(trans.parent / "19-198-0001.flac")
        if case == "corrupt":
            (trans.parent / "19-198-0001.flac").write_bytes(b"not audio")
    if case.startswith("kaldi"):
        root.mkdir()
        (root / "text").write_text("u1 hello\n")
        if case == "kaldi_pipe":
            (root / "wav.scp").write_text("u1 sph2pipe -f wav a.wv1 |\n")
    with pytest.raises(ConfigError, match=match) as err:
        (load_kaldi if case.startswith("kaldi") else load_librispeech)(root)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_task_end_to_end_and_errors(compose_cfg, tmp_path):
    from repro.tasks.asr import aggregate, run

    common = ["experiment=smoke_asr", f"task.data_dir={tmp_path / 'speech'}", "task.corpus.n_sentences=8",
              "trainer.max_steps=4", "trainer.log_every=2", "trainer.eval_every=2", "trainer.progress=false",
              "task.batch_size=4", "task.beam_size=4", "task.real_test=null"]
    rows = []
    for enc in ("bilstm", "linear"):
        out = tmp_path / enc
        cfg = compose_cfg(*common, f"encoder={enc}", f"+task.out_dir={out}")
        run(cfg)
        rows += read_jsonl(out / "results.jsonl")
        summary = rows[-1]
        assert summary["kind"] == "summary" and summary["status"] == "ok" and summary["model"] == enc
        assert summary["valid_per"] >= 0 and summary["test_per_beam"] >= 0 and summary["time_per_epoch_s"] > 0
        assert (any(r["kind"] == "eval" and "per" in r for r in rows)
                and {"git_sha", "device", "versions"} <= set(summary))
        # hypotheses.csv: every decoded utterance beside its reference; pooled, they give the set's PER
        hyps = pd.read_csv(out / "hypotheses.csv", keep_default_na=False)
        valid = hyps[hyps.split == "valid"]
        assert len(valid) == summary["valid_n_utts"] and set(hyps.split) == {"valid", "test"}
        assert jiwer.wer(list(valid.reference), list(valid.greedy)) == pytest.approx(summary["valid_per"])
        assert jiwer.wer(list(valid.reference), list(valid.beam)) == pytest.approx(summary["valid_per_beam"])
    tab = aggregate(rows, tmp_path)
    assert list(tab.model) == ["bilstm", "linear"] and (tmp_path / "asr_table.csv").is_file()
    for bad, match in [("task.source=wav", "valid: tts, librispeech, kaldi"),
                       ("model.encoder=gru", "model.encoder='gru'")]:
        with pytest.raises(ConfigError, match=match):
            run(compose_cfg(*common, bad, f"+task.out_dir={tmp_path / 'bad'}"))


@pytest.mark.parametrize("deeper", [False, True])
def test_a_data_dir_behind_a_dangling_link_is_one_line(tmp_path, deeper):
    """task.data_dir a symbolic link whose target is gone (moved, unmounted), or a folder under
    one: one line naming the link and its target, nothing made or generated."""
    link = tmp_path / "speech"
    link.symlink_to(tmp_path / "gone")
    root = link / "cache" if deeper else link
    with pytest.raises(ConfigError) as err:
        generate(CorpusSettings(**TINY), root=root, progress=False)
    who = "it" if not deeper else str(link)
    assert str(err.value) == (f"task.data_dir={root}: {who} is a symbolic link to {tmp_path / 'gone'}, which does "
                              f"not exist; restore its target or set task.data_dir to a folder")
    assert not (tmp_path / "gone").exists()


def test_a_dangling_data_dir_from_the_command_line(tmp_path):
    from run_cli import run_py

    (tmp_path / "speech").symlink_to(tmp_path / "gone")
    res = run_py("experiment=smoke_asr", f"task.data_dir={tmp_path / 'speech'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [f"error: task.data_dir={tmp_path / 'speech'}: it is a symbolic link "
                                               f"to {tmp_path / 'gone'}, which does not exist; restore its target or "
                                               f"set task.data_dir to a folder"]
