"""The copy (sequence duplication) task of the paper's Figure 2, generated on the fly.

A sequence of N = max_len tokens holds n random symbols a_1..a_n (from 1..n_symbols), the
separator, the same n symbols again, then padding:

    a_1 .. a_n  SEP  a_1 .. a_n  PAD .. PAD          (SEP = PAD = 0, as in the authors' script)

The model reads it causally and predicts each next token. By default only the copy is scored:
the targets at positions n .. 2n-1 (whose next tokens are the repeated a_1..a_n), so that a
perfect copier reaches loss 0 and accuracy 1. The authors' copy script also scores position n-1
(predicting the separator): score_separator=True does as they do (the paper_authors preset).
"""
import torch

PAD = SEP = 0


class CopyTask:
    """Endless batches {"tokens", "targets", "mask"}, each (B, N), from a seeded generator.

    n is drawn uniformly from [min_copy, max_copy] per sequence; by default
    [N // 4, (N - 1) // 2 - 1], the authors' range ([32, 62] for N = 128).
    state_dict() is the generator state, so a restored stream yields the same next batches.
    """

    def __init__(self, batch_size: int, max_len: int = 128, n_symbols: int = 10,
                 min_copy: int | None = None, max_copy: int | None = None, seed: int = 0,
                 score_separator: bool = False):
        self.min_copy = max_len // 4 if min_copy is None else min_copy
        self.max_copy = (max_len - 1) // 2 - 1 if max_copy is None else max_copy
        if batch_size < 1 or n_symbols < 1:
            raise ValueError(f"copy task: batch_size and n_symbols must be >= 1; "
                             f"got batch_size={batch_size}, n_symbols={n_symbols}")
        if not 1 <= self.min_copy <= self.max_copy or 2 * self.max_copy + 1 > max_len:
            raise ValueError(f"copy task: need 1 <= min_copy <= max_copy and 2 * max_copy + 1 <= max_len; "
                             f"got min_copy={self.min_copy}, max_copy={self.max_copy}, max_len={max_len}")
        self.batch_size, self.max_len, self.n_symbols = batch_size, max_len, n_symbols
        self.first_scored = -1 if score_separator else 0  # position n + this is the first target scored
        self.generator = torch.Generator().manual_seed(seed)
        self.batches = 0  # batches drawn so far: the stream position, for the logs

    @property
    def vocab_size(self) -> int:
        return self.n_symbols + 1  # symbols 1..n_symbols and SEP/PAD = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        B, N, g = self.batch_size, self.max_len, self.generator
        n = torch.randint(self.min_copy, self.max_copy + 1, (B, 1), generator=g)  # (B, 1)
        a = torch.randint(1, self.n_symbols + 1, (B, N), generator=g)            # (B, N), first n used
        pos = torch.arange(N)                                                      # (N,)
        first, second = pos < n, (pos > n) & (pos <= 2 * n)                        # (B, N)
        src = (pos - n - 1).clamp(min=0)                                           # second half reads a[pos - n - 1]
        seq = torch.where(first, a, PAD)
        seq = torch.where(second, a.gather(1, src), seq)                           # (B, N)
        targets = torch.cat([seq[:, 1:], torch.full((B, 1), PAD)], 1)              # next token
        mask = (pos >= n + self.first_scored) & (pos < 2 * n)                      # targets scored
        self.batches += 1
        return {"tokens": seq, "targets": targets, "mask": mask}

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "batches": self.batches}

    def load_state_dict(self, state: dict):
        self.generator.set_state(state["generator"])
        self.batches = state["batches"]
