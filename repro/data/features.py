"""Speech features and batches: 40-dimensional log-mel filterbanks (torchaudio; the paper's
features), normalisation, SpecAugment (torchaudio's masking transforms), and length-bucketed
padded batches with each utterance's frame count (the encoders mask padding from it, repro.models.ctc)."""
import numpy as np
import soundfile as sf
import torch
import torchaudio
from torch import nn

from repro.common.errors import ConfigError
from repro.data.batches import ShuffledBatches
from repro.data.speech.phonemes import encode

KINDS = ("kaldi", "mel")
NORMS = ("utterance", "global", "none")


class LogMelFilterbank(nn.Module):
    """wave (S,) at sample_rate -> (T, n_mels), 25 ms windows every 10 ms.
    kind=kaldi: torchaudio.compliance.kaldi.fbank (Kaldi's recipe, as WSJ systems use);
    kind=mel: torchaudio.transforms.MelSpectrogram (power) followed by log."""

    def __init__(self, n_mels: int = 40, sample_rate: int = 16000, kind: str = "kaldi"):
        super().__init__()
        if kind not in KINDS:
            raise ConfigError(f"task.features.kind={kind!r}; valid: {', '.join(KINDS)}")
        self.n_mels, self.sample_rate, self.kind = n_mels, sample_rate, kind
        win, hop = sample_rate * 25 // 1000, sample_rate * 10 // 1000
        self.mel = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=win, hop_length=hop, n_mels=n_mels) if kind == "mel" else None

    def forward(self, wave):
        if self.kind == "kaldi":
            # dither 0: the same features on every pass (noise is in the corpus already)
            return torchaudio.compliance.kaldi.fbank(wave[None] * 32768, num_mel_bins=self.n_mels, frame_length=25.0,
                                                     frame_shift=10.0, dither=0.0, sample_frequency=self.sample_rate)
        return torch.log(self.mel(wave) + 1e-6).T  # (n_mels, T) -> (T, n_mels)


def read_audio(path, sample_rate: int = 16000) -> torch.Tensor:
    """Mono float waveform at sample_rate (first channel of a multi-channel file)."""
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except RuntimeError as err:
        raise ConfigError(f"{path}: unreadable audio ({str(err).splitlines()[0]})") from err
    wave = torch.from_numpy(np.ascontiguousarray(data[:, 0]))
    return torchaudio.functional.resample(wave, sr, sample_rate) if sr != sample_rate else wave


class SpeechDataset(torch.utils.data.Dataset):
    """Utterance rows (corpus manifest or a loader's) -> items {features (T, F), labels (L,)}.
    Features are computed once; normalisation per utterance (mean/variance of each bin) or
    global (statistics given, from the training set); SpecAugment only when `augment` is on."""

    def __init__(self, rows, fbank: LogMelFilterbank, norm: str = "utterance", stats=None, spec_augment=None,
                 progress: bool = False):
        if norm not in NORMS:
            raise ConfigError(f"task.features.norm={norm!r}; valid: {', '.join(NORMS)}")
        from tqdm import tqdm

        self.rows, self.norm = rows, norm
        with torch.no_grad():
            self.features = [fbank(read_audio(r["audio"], fbank.sample_rate)) for r in tqdm(rows, desc="features", disable=not progress)]
        self.labels = [torch.tensor(encode(r["phonemes"]), dtype=torch.long) for r in rows]
        if norm == "global":
            self.stats = stats or global_stats(self.features)
        # normalised once here: only SpecAugment differs from one fetch to the next
        self.features = [self._normalise(x) for x in self.features]
        self.spec_augment, self.augment = spec_augment, False

    def _normalise(self, x):
        if self.norm == "utterance":
            return (x - x.mean(0)) / (x.std(0) + 1e-5)
        if self.norm == "global":
            return (x - self.stats[0]) / self.stats[1]
        return x

    def __len__(self):
        return len(self.rows)

    def lengths(self):
        return [len(f) for f in self.features]

    def __getitem__(self, i):
        x = self.features[i]
        if self.augment and self.spec_augment is not None:
            x = self.spec_augment(x.T[None])[0].T  # torchaudio masks (..., freq, time)
        return {"features": x, "labels": self.labels[i], "index": i}


def global_stats(features):
    cat = torch.cat(features)
    return cat.mean(0), cat.std(0) + 1e-5


def spec_augment(freq_mask: int = 0, time_mask: int = 0, n_masks: int = 2):
    """n_masks frequency masks of up to freq_mask bins and time masks of up to time_mask frames."""
    if not freq_mask and not time_mask:
        return None
    parts = []
    for _ in range(n_masks):
        if freq_mask:
            parts.append(torchaudio.transforms.FrequencyMasking(freq_mask))
        if time_mask:
            parts.append(torchaudio.transforms.TimeMasking(time_mask))
    return nn.Sequential(*parts)


def collate(items):
    """Padded batch: features (B, T, F), frame and label lengths (the models mask padding from
    the frame lengths), labels concatenated (CTC's flat form) and padded (B, L)."""
    return {"features": nn.utils.rnn.pad_sequence([it["features"] for it in items], batch_first=True),  # (B, T, F)
            "lengths": torch.tensor([len(it["features"]) for it in items]),
            "labels": nn.utils.rnn.pad_sequence([it["labels"] for it in items], batch_first=True),     # (B, L)
            "label_lengths": torch.tensor([len(it["labels"]) for it in items]),
            "index": torch.tensor([it["index"] for it in items])}


class BucketedBatches(ShuffledBatches):
    """Length-bucketed training batches: utterances sorted by length are cut into batches of
    batch_size (little padding), and each epoch visits the batches in an order drawn from
    (seed, epoch); within a bucket of similar lengths the members are shuffled first, so batches
    differ between epochs. The resumable stream is ShuffledBatches'; only `batches` differs.
    Items drawn through it are augmented (SpecAugment, when the dataset has one)."""

    def __init__(self, dataset, batch_size: int, seed: int = 0, bucket_factor: int = 4):
        if batch_size < 1 or len(dataset) < batch_size:
            raise ConfigError(f"task.batch_size={batch_size}: need 1 <= batch_size <= {len(dataset)} training utterances")
        super().__init__(dataset, batch_size, seed=seed, drop_last=True, collate_fn=collate)
        self.bucket_factor = bucket_factor
        self.lengths = torch.tensor(dataset.lengths())
        dataset.augment = True  # the training set (eval_batches turns it off for its own draw, then back)

    def batches(self, epoch: int) -> list[list[int]]:
        g = self.generator(epoch)
        order = torch.argsort(self.lengths + torch.rand(len(self.lengths), generator=g) * 1e-3, stable=True)
        chunk = self.batch_size * self.bucket_factor  # shuffle inside buckets of similar length
        order = torch.cat([c[torch.randperm(len(c), generator=g)] for c in order.split(chunk)])
        out = [b.tolist() for b in order.split(self.batch_size) if len(b) == self.batch_size]
        for b in out:  # each batch in length order again (padding stays small)
            b.sort(key=lambda i: int(self.lengths[i]))
        return [out[i] for i in torch.randperm(len(out), generator=g).tolist()]

    def __len__(self):
        return len(self.lengths) // self.batch_size  # full batches per epoch (a short last one is dropped)


def eval_batches(dataset, batch_size: int) -> list[dict]:
    """Every utterance once, in length order (no augmentation)."""
    lengths = dataset.lengths()
    order = sorted(range(len(dataset)), key=lengths.__getitem__)
    was, dataset.augment = dataset.augment, False
    out = [collate([dataset[i] for i in order[s:s + batch_size]]) for s in range(0, len(order), batch_size)]
    dataset.augment = was
    return out
