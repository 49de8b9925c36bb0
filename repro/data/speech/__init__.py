"""Speech data: the generated read-speech corpus, loaders for real corpora, the phoneme inventory."""
from repro.data.speech.corpus import SAMPLE_RATE, CorpusSettings, generate, load_manifest
from repro.data.speech.lexicon import espeak_summary, espeak_text, normalise_transcript, words_to_arpabet
from repro.data.speech.loaders import load_kaldi, load_librispeech, load_pocketsphinx
from repro.data.speech.phonemes import BLANK, LABELS, PHONEMES, espeak_to_arpabet

__all__ = ["BLANK", "CorpusSettings", "LABELS", "PHONEMES", "SAMPLE_RATE", "espeak_summary", "espeak_text",
           "espeak_to_arpabet", "generate", "load_kaldi", "load_librispeech", "load_manifest", "load_pocketsphinx",
           "normalise_transcript", "words_to_arpabet"]
