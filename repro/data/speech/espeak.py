"""espeak-ng through ctypes, from the PyPI wheel espeakng-loader (it bundles the shared library
and its data, so nothing outside requirements.txt is needed). One engine per process: the
library keeps global state, so every call goes through the module-level `engine()`."""
import ctypes
import threading
from functools import lru_cache

import numpy as np

AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER, CHARS_UTF8 = 1, 1
RATE, VOLUME, PITCH, RANGE = 1, 2, 3, 4
PHONEME_SEPARATOR = ord("_") << 8  # espeak_TextToPhonemes: ASCII names, "_" between phonemes
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class Espeak:
    def __init__(self):
        import espeakng_loader

        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                     ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_int]
        lib.espeak_Info.restype = ctypes.c_char_p
        lib.espeak_Info.argtypes = [ctypes.c_void_p]
        self.sample_rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0)
        if self.sample_rate <= 0:
            raise RuntimeError(f"espeak-ng failed to initialise from {espeakng_loader.get_data_path()}")
        self.version = lib.espeak_Info(None).decode()
        self._chunks = []
        self._callback = _CALLBACK(self._collect)  # kept alive: the library holds a raw pointer
        lib.espeak_SetSynthCallback(self._callback)
        self.lib, self.lock = lib, threading.Lock()

    def _collect(self, wav, n, events):
        if n > 0 and wav:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0

    def _voice(self, voice, rate, pitch):
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r} (e.g. en-us, en-us+f3, en-us+m1, en-us+klatt)")
        self.lib.espeak_SetParameter(RATE, int(rate), 0)
        self.lib.espeak_SetParameter(PITCH, int(pitch), 0)

    def synth(self, text: str, voice: str = "en-us", rate: int = 175, pitch: int = 50) -> np.ndarray:
        """int16 samples at self.sample_rate (22,050 Hz)."""
        with self.lock:
            self._voice(voice, rate, pitch)
            self._chunks = []
            data = text.encode()
            self.lib.espeak_Synth(data, len(data) + 1, 0, POS_CHARACTER, 0, CHARS_UTF8, None, None)
            return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)

    def phonemes(self, text: str, voice: str = "en-us") -> list[str]:
        """The engine's own transcription: its ASCII phoneme names, with stress marks, in order."""
        with self.lock:
            self._voice(voice, 175, 50)
            ptr, out = ctypes.c_char_p(text.encode()), []
            while ptr.value:  # one clause per call; the pointer advances
                clause = self.lib.espeak_TextToPhonemes(ctypes.byref(ptr), CHARS_UTF8, PHONEME_SEPARATOR)
                for word in (clause or b"").decode().split():
                    out += word.split("_")
            return out


@lru_cache(maxsize=1)
def engine() -> Espeak:
    return Espeak()
