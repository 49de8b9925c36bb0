"""The offline "WSJ-style" read-speech corpus: English sentences spoken by espeak-ng in several
voices, speaking rates and pitches, with noise added; targets are the engine's own phoneme
transcription (mapped to ARPAbet). Deterministic from the seed; generated once into
data/speech/tts-<hash of the settings>/ (audio/*.flac + manifest.jsonl + settings.json, written
to a temporary folder and renamed, so an interrupted run leaves no half corpus).

Splits: sentences are dealt into train / valid / test, so no sentence is in two splits; train and
valid are spoken by the training voices, test only by a held-out voice.

Determinism: sentences, splits, voices, rates, pitches, noise and targets follow the seed
exactly; the waveforms themselves carry espeak-ng's own run-to-run jitter (its synthesiser keeps
state between calls, e.g. a few samples of timing), which no public seed controls."""
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio
from tqdm import tqdm

from repro.common.errors import ConfigError
from repro.common.results import REPO, atomic_write, read_jsonl, write_jsonl
from repro.data.speech.espeak import engine
from repro.data.speech.phonemes import espeak_to_arpabet
from repro.data.speech.sentences import english_sentences

SAMPLE_RATE = 16000
VERSION = 1  # bump when the generation changes, so old caches are not reused


@dataclass
class CorpusSettings:
    n_sentences: int = 1200
    renditions: int = 3              # utterances per training sentence (voice/rate/pitch/noise drawn anew)
    valid_fraction: float = 0.08
    test_fraction: float = 0.08
    min_words: int = 4
    max_words: int = 20
    voices: list = field(default_factory=lambda: [f"en-us+{v}" for v in
                                                  ("m1", "m2", "m3", "m4", "m5", "m7", "f1", "f2", "f4", "klatt")])
    test_voice: str = "en-us+f3"     # held out: only the test split uses it
    rate: tuple = (140, 210)         # words per minute, uniform
    pitch: tuple = (30, 70)          # espeak pitch 0..100, uniform
    snr_db: tuple = (10.0, 30.0)     # white noise at this SNR, uniform
    seed: int = 0

    def __post_init__(self):
        if self.n_sentences < 3 or self.renditions < 1:
            raise ConfigError(f"task.corpus: need n_sentences >= 3 and renditions >= 1; got {self.n_sentences}, "
                              f"{self.renditions}")
        if (not 0 < self.valid_fraction < 1 or not 0 < self.test_fraction < 1
                or self.valid_fraction + self.test_fraction >= 1):
            raise ConfigError("task.corpus: valid_fraction and test_fraction must be in (0, 1) with a sum below 1")
        if not 1 <= self.min_words <= self.max_words:
            raise ConfigError(f"task.corpus: need 1 <= min_words <= max_words; got {self.min_words}, {self.max_words}")
        if self.test_voice in self.voices:
            raise ConfigError(f"task.corpus.test_voice={self.test_voice!r} is also a training voice; hold it out")

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "version": VERSION, "espeak": engine().version}, sort_keys=True,
                          default=list)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]


def _render(text, voice, rate, pitch, snr_db, rng):
    """One utterance: TTS at 22.05 kHz -> 16 kHz float, white noise at snr_db, peak-safe int16."""
    eng = engine()
    pcm = eng.synth(text, voice, rate, pitch)
    if pcm.size == 0 or not np.any(pcm):
        raise RuntimeError(f"espeak-ng produced no audio for {text!r} ({voice})")
    wav = torchaudio.functional.resample(torch.from_numpy(pcm.astype(np.float32) / 32768), eng.sample_rate,
                                         SAMPLE_RATE).numpy()
    noise = rng.standard_normal(wav.shape).astype(np.float32)
    noise *= np.sqrt(np.mean(wav ** 2) / 10 ** (snr_db / 10)) / max(np.sqrt(np.mean(noise ** 2)), 1e-12)
    wav = wav + noise
    return np.clip(wav / max(1.0, float(np.abs(wav).max()) / 0.99), -1, 1)


def cache_folder(root: Path) -> Path:
    """root (task.data_dir) as a folder to cache corpora in, made if missing. A dangling symbolic
    link on its way (a target moved or unmounted), a file, or a folder that cannot be made is one
    line naming the path."""
    for p in (root, *root.parents):
        if p.is_symlink() and not p.exists():
            raise ConfigError(f"task.data_dir={root}: {'it' if p == root else p} is a symbolic link to "
                              f"{os.readlink(p)}, which does not exist; restore its target or set task.data_dir "
                              f"to a folder")
    if root.exists() and not root.is_dir():
        raise ConfigError(f"task.data_dir={root}: not a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"task.data_dir={root}: cannot make the folder ({err.strerror})") from err
    return root


def generate(settings: CorpusSettings, root=None, progress: bool = True) -> Path:
    """The corpus folder for these settings, generated first if it is not cached yet."""
    root = cache_folder(Path(root or REPO / "data" / "speech"))
    out = root / f"tts-{settings.key()}"
    if (out / "manifest.jsonl").exists():
        return out
    s = settings
    sentences = english_sentences(s.n_sentences, s.min_words, s.max_words)
    if len(sentences) < s.n_sentences:
        raise ConfigError(f"task.corpus.n_sentences={s.n_sentences}, but only {len(sentences)} sentences of "
                          f"{s.min_words}..{s.max_words} words are available; lower it or widen the word range")
    rng = np.random.default_rng(s.seed)
    chosen = [sentences[i] for i in rng.permutation(len(sentences))[:s.n_sentences]]
    n_valid = max(1, round(s.valid_fraction * s.n_sentences))
    n_test = max(1, round(s.test_fraction * s.n_sentences))
    plan = []  # (split, sentence index, text, voice)
    for i, text in enumerate(chosen):
        split = "test" if i < n_test else "valid" if i < n_test + n_valid else "train"
        for r in range(s.renditions if split == "train" else 1):
            voice = s.test_voice if split == "test" else s.voices[rng.integers(len(s.voices))]
            plan.append((split, i, r, text, voice, int(rng.integers(s.rate[0], s.rate[1] + 1)),
                         int(rng.integers(s.pitch[0], s.pitch[1] + 1)), float(rng.uniform(*s.snr_db))))
    _remove_stale_builds(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-{os.getpid()}-", dir=root))
    try:
        (tmp / "audio").mkdir()
        rows, phon_cache = [], {}
        for k, (split, i, r, text, voice, rate, pitch, snr) in enumerate(tqdm(plan, desc="speech corpus", unit="utt",
                                                                               disable=not progress)):
            if (text, voice) not in phon_cache:
                phon_cache[text, voice] = espeak_to_arpabet(engine().phonemes(text, voice))
            phonemes, unmapped = phon_cache[text, voice]
            wav = _render(text, voice, rate, pitch, snr, np.random.default_rng([s.seed, k]))
            uid = f"{split}-s{i:05d}-r{r}"
            sf.write(tmp / "audio" / f"{uid}.flac", wav, SAMPLE_RATE, subtype="PCM_16")
            rows.append({"id": uid, "split": split, "audio": f"audio/{uid}.flac", "text": text,
                         "phonemes": phonemes, "unmapped": unmapped, "speaker": voice, "rate": rate,
                         "pitch": pitch, "snr_db": round(snr, 2), "n_samples": len(wav)})
        atomic_write(tmp / "settings.json", json.dumps({**asdict(s), "version": VERSION, "espeak": engine().version,
                                                        "n_utterances": len(rows),
                                                        "sentence_source":
                                                            "python docs (pydoc_data.topics) + stdlib docstrings"},
                                                       indent=1, default=list))
        write_jsonl(tmp / "manifest.jsonl", rows)
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished the same corpus first: keep theirs
            if not (out / "manifest.jsonl").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _remove_stale_builds(root: Path):
    """Temporary folders of builds whose process is gone (killed: SIGKILL, a power cut); a build
    stopped by SIGTERM or Ctrl-C under run.py removes its own."""
    for d in root.glob(".tts-*-*-*"):
        try:
            pid = int(d.name.split("-")[2])
            os.kill(pid, 0)  # alive (ours or another build's): leave it
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            pass


def load_manifest(folder) -> list[dict]:
    """The utterances of a generated corpus, with absolute audio paths. A manifest that is cut
    off or short of the utterances its settings.json counts is refused (a damaged corpus would
    otherwise train on fewer utterances under the same id)."""
    folder = Path(folder)
    path = folder / "manifest.jsonl"
    if not path.exists():
        raise ConfigError(f"{path}: no corpus manifest here")
    text = path.read_text()
    rows = read_jsonl(path) if text.endswith("\n") else None
    settings = folder / "settings.json"
    expected = json.loads(settings.read_text()).get("n_utterances") if settings.is_file() else None
    if rows is None or (expected is not None and len(rows) != expected):
        found = "its last line is cut off" if rows is None else f"it holds {len(rows)} utterances, not {expected}"
        raise ConfigError(f"{path} is damaged ({found}): delete {folder} and the corpus is generated again")
    for r in rows:
        r["audio"] = str(folder / r["audio"])
    return rows
