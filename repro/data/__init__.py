"""Datasets. Training streams are iterators of batches with state_dict() / load_state_dict(),
so a resumed run continues the exact stream (repro.training relies on it): CopyTask draws
batches from a seeded generator; ShuffledBatches serves any map-style dataset."""
from repro.data.batches import ShuffledBatches
from repro.data.copy import PAD, SEP, CopyTask

__all__ = ["CopyTask", "PAD", "SEP", "ShuffledBatches"]
