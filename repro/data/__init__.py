"""Datasets. Training streams are iterators of batches with state_dict() / load_state_dict(),
so a resumed run continues the exact stream (repro.training relies on it)."""
from .copy import PAD, SEP, CopyTask

__all__ = ["CopyTask", "PAD", "SEP"]
