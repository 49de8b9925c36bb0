"""The phoneme inventory: the 39 ARPAbet phonemes of CMUdict (stress stripped), as in WSJ/TIMIT
recipes. Synthetic utterances take the engine's own transcription (espeak-ng's ASCII phoneme
names, mapped below); real corpora take CMUdict pronunciations of their word transcripts
(repro/data/speech/lexicon.py, espeak-ng's for words CMUdict lacks). One
inventory for both, so a model trained on the generated corpus can be scored on real speech."""
import re

PHONEMES = ("AA AE AH AO AW AY B CH D DH EH ER EY F G HH IH IY JH K L M N NG OW OY P R S SH T TH "
            "UH UW V W Y Z ZH").split()
BLANK = 0  # CTC blank; phoneme i has label i + 1
LABELS = {p: i + 1 for i, p in enumerate(PHONEMES)}

# espeak-ng en-us ASCII names -> ARPAbet. r-coloured and reduced vowels have no single ARPAbet
# symbol: they become the sequence CMUdict would write (A@ "start" -> AA R).
ESPEAK = {
    "I": "IH", "I2": "IH", "I#": "IH", "@": "AH", "@2": "AH", "@5": "AH", "a#": "AH", "V": "AH", "@-": "AH",
    "@L": "AH L", "3": "ER", "3:": "ER", "a": "AE", "aa": "AE", "A:": "AA", "A": "AA", "0": "AA",
    "O:": "AO", "O": "AO", "O2": "AO", "E": "EH", "e": "EH", "eI": "EY", "aI": "AY", "aU": "AW",
    "oU": "OW", "OI": "OY", "U": "UH", "u:": "UW", "u": "UW", "i": "IY", "i:": "IY",
    "A@": "AA R", "O@": "AO R", "o@": "AO R", "e@": "EH R", "i@": "IY AH", "i@3": "IH R",
    "U@": "UH R", "aI3": "AY ER", "aI@": "AY ER", "aU@": "AW ER",
    "p": "P", "b": "B", "t": "T", "d": "D", "k": "K", "g": "G", "f": "F", "v": "V", "s": "S",
    "z": "Z", "h": "HH", "m": "M", "n": "N", "l": "L", "w": "W", "T": "TH", "D": "DH", "S": "SH",
    "Z": "ZH", "N": "NG", "j": "Y", "tS": "CH", "dZ": "JH", "r": "R", "r-": "R", "t#": "T",
    "t2": "T", "d#": "D", "n-": "N", "l-": "L", "m-": "M", "?": "T", "x": "HH", "!w": "W", "W": "W",
}
MARKS = re.compile(r"['\",%=]")  # stress and syllable marks
PAUSES = {"", ":", ";", "!", "_!", "_:", "-"}


def espeak_to_arpabet(names):
    """espeak-ng phoneme names (one word's, or an utterance's) -> (ARPAbet list, unmapped names).
    ER R and R R (an r-coloured vowel before the engine's linking r) collapse, as CMUdict has them."""
    out, unmapped = [], []
    for name in names:
        name = MARKS.sub("", name)
        if name in PAUSES:
            continue
        mapped = ESPEAK.get(name) or ESPEAK.get(name.rstrip("#2:-"))
        if mapped is None:
            unmapped.append(name)
            continue
        for p in mapped.split():
            if p == "R" and out and out[-1] in ("ER", "R"):
                continue
            out.append(p)
    return out, unmapped


def encode(phonemes) -> list[int]:
    return [LABELS[p] for p in phonemes]


def decode(labels) -> list[str]:
    return [PHONEMES[i - 1] for i in labels if i != BLANK]
