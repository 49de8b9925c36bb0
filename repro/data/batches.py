"""Resumable shuffled mini-batches over any map-style dataset (len + __getitem__), for the
training loop's train_data: epoch e's batches are drawn from (seed, e), so the stream position
(epoch, batches drawn in it) is its whole state and a resumed run sees the same batches.
Under DDP each rank takes every world_size-th item of the same permutation.

A subclass changes only `batches(epoch)`, how an epoch is cut into batches (e.g.
repro.data.features.BucketedBatches, length-bucketed speech batches); the stream is this one."""
import torch
from torch.utils.data import default_collate


class ShuffledBatches:
    def __init__(self, dataset, batch_size: int, seed: int = 0, drop_last: bool = True,
                 collate_fn=default_collate, rank: int = 0, world_size: int = 1):
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"batches: need batch_size >= 1 and 0 <= rank < world_size; "
                             f"got batch_size={batch_size}, rank={rank}, world_size={world_size}")
        per_rank = len(dataset) // world_size
        if per_rank < (batch_size if drop_last else 1):
            raise ValueError(f"batches: {len(dataset)} items over {world_size} rank(s) cannot fill a batch of {batch_size}")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.drop_last, self.collate_fn, self.rank, self.world_size = drop_last, collate_fn, rank, world_size
        self.epoch, self.index = 0, 0  # index: batches drawn in this epoch
        self._batches = None  # this epoch's batches, built on first use (after a load_state_dict too)

    def generator(self, epoch: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's item indices for the epoch, in order."""
        perm = torch.randperm(len(self.dataset), generator=self.generator(epoch))
        per_rank = len(self.dataset) // self.world_size  # equal shares: ranks stay in step
        return perm[self.rank::self.world_size][:per_rank]

    def batches(self, epoch: int) -> list[list[int]]:
        """The epoch's batches, as lists of item indices, in the order they are served."""
        return [b.tolist() for b in self.order(epoch).split(self.batch_size)
                if len(b) == self.batch_size or not self.drop_last]

    def __iter__(self):
        return self

    def __next__(self):
        if self._batches is None:
            self._batches = self.batches(self.epoch)
        if self.index >= len(self._batches):
            self.epoch, self.index, self._batches = self.epoch + 1, 0, self.batches(self.epoch + 1)
        idx = self._batches[self.index]
        self.index += 1
        return self.collate_fn([self.dataset[i] for i in idx])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.index}

    def load_state_dict(self, state: dict):
        if "batch" not in state:  # {"epoch", "index"}: items drawn (ShuffledBatches) or batches (BucketedBatches)
            raise ValueError(f"stream state {state} is from before the stream counted batches; "
                             "its position is ambiguous: train this run again from the start")
        self.epoch, self.index, self._batches = state["epoch"], state["batch"], None
