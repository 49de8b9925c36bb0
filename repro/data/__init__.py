"""Datasets. Training streams are iterators of batches with state_dict() / load_state_dict(),
so a resumed run continues the exact stream (repro.training relies on it): CopyTask draws
batches from a seeded generator; ShuffledBatches serves any map-style dataset."""
from .batches import ShuffledBatches
from .copy import PAD, SEP, CopyTask

__all__ = ["CopyTask", "PAD", "SEP", "ShuffledBatches"]
