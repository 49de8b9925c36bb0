"""The delta rule: its recurrence (reference) and the chunked WY / UT PyTorch path (chunked),
every device."""
