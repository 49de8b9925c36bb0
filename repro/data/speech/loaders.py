"""Real corpora, for whoever has them: the LibriSpeech layout, Kaldi data dirs (WSJ users
convert SPHERE to WAV/FLAC and list them in wav.scp), and the real read utterances of Debian's
pocketsphinx-testdata. Each returns utterance rows like the generated corpus's manifest (id,
audio path, text, ARPAbet phonemes, speaker); audio is read later with soundfile. The phonemes
come from the transcript's spoken words (WSJ markers and punctuation normalised as the Kaldi and
ESPnet recipes do) through CMUdict, or espeak-ng for a word CMUdict lacks: each row also carries
`words` (the normalised transcript) and `espeak_words` (the words that took espeak-ng's path;
lexicon.espeak_summary counts them). A missing or malformed corpus, or a word no path can
pronounce, is a one-line ConfigError naming the file."""
import re
from pathlib import Path

import soundfile as sf

from repro.common.errors import ConfigError
from repro.data.speech.lexicon import transcript_to_arpabet

POCKETSPHINX = Path("/usr/share/pocketsphinx/test/data")  # Debian: apt-get install pocketsphinx-testdata


def _utterance(uid, audio, text, speaker, where, text_file=None):
    """`where` lists the audio (and the transcript, unless `text_file` is given)."""
    audio = Path(audio)
    if not audio.is_file():
        raise ConfigError(f"{where}: audio file {audio} for utterance {uid!r} does not exist")
    try:
        info = sf.info(str(audio))
    except RuntimeError as err:
        raise ConfigError(f"{audio}: unreadable audio ({str(err).splitlines()[0]})") from err
    phonemes, words, by_espeak = transcript_to_arpabet(text, f"{text_file or where} ({uid})")
    return {"id": uid, "audio": str(audio), "text": text, "words": " ".join(words), "phonemes": phonemes,
            "espeak_words": by_espeak, "speaker": speaker, "n_samples": info.frames, "sample_rate": info.samplerate}


def _pairs(path: Path):
    """'key rest of line' lines -> [(key, rest)]; a line without both is malformed."""
    if not path.is_file():
        raise ConfigError(f"{path}: missing")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.strip().split(maxsplit=1)
        if len(parts) != 2:
            raise ConfigError(f"{path}:{n}: malformed line {line.strip()!r}; expected '<utterance id> <value>'")
        out.append((parts[0], parts[1]))
    return out


def load_librispeech(root, split: str = "test") -> list[dict]:
    """root/<speaker>/<chapter>/<speaker>-<chapter>.trans.txt + <id>.flac (e.g. LibriSpeech/dev-clean)."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root}: LibriSpeech folder does not exist")
    rows = []
    for trans in sorted(root.glob("*/*/*.trans.txt")):
        speaker = trans.parent.parent.name
        for uid, text in _pairs(trans):
            rows.append({**_utterance(uid, trans.parent / f"{uid}.flac", text, speaker, str(trans)), "split": split})
    if not rows:
        raise ConfigError(f"{root}: no <speaker>/<chapter>/*.trans.txt found (LibriSpeech layout)")
    return rows


def load_kaldi(folder, split: str = "test") -> list[dict]:
    """A Kaldi data dir: wav.scp ('<id> <path>', plain files only) and text ('<id> <words>');
    utt2spk when present."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: Kaldi data dir does not exist")
    wavs = dict(_pairs(folder / "wav.scp"))
    spk = dict(_pairs(folder / "utt2spk")) if (folder / "utt2spk").exists() else {}
    rows = []
    for uid, text in _pairs(folder / "text"):
        if uid not in wavs:
            raise ConfigError(f"{folder / 'text'}: utterance {uid!r} has no entry in {folder / 'wav.scp'}")
        path = wavs[uid]
        if path.endswith("|"):
            raise ConfigError(f"{folder / 'wav.scp'}: {uid!r} is a pipe command; convert to WAV/FLAC files first")
        path = Path(path) if Path(path).is_absolute() else folder / path
        rows.append({**_utterance(uid, path, text, spk.get(uid, uid), str(folder / "wav.scp"),
                                   folder / "text"), "split": split})
    if not rows:
        raise ConfigError(f"{folder / 'text'}: no utterances")
    return rows


SPHINX_LINE = re.compile(r"^(?:<s>)?\s*(.*?)\s*(?:</s>)?\s*\(([^()]+)\)\s*$")


def load_pocketsphinx(root=POCKETSPHINX) -> list[dict]:
    """The real read utterances of pocketsphinx-testdata (librivox: 5 Sense and Sensibility
    sentences; cards: 5 card names), from their sphinx transcription files. Empty list when the
    package is not installed: this set is an extra, never required."""
    root = Path(root)
    sets = [(root / "librivox" / "transcription", root / "librivox"), (root / "cards" / "cards.transcription", root / "cards")]
    rows = []
    for trans, folder in sets:
        if not trans.exists():
            continue
        for n, line in enumerate(trans.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            m = SPHINX_LINE.match(line.strip())
            if not m:
                raise ConfigError(f"{trans}:{n}: malformed line {line.strip()!r}; expected '<s> words </s> (id)'")
            text, uid = m.group(1), m.group(2)
            rows.append({**_utterance(uid, folder / f"{uid}.wav", text, folder.name, str(trans)), "split": "real"})
    return rows
