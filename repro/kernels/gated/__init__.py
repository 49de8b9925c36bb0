"""The decayed causal product (retention, RFA, GLA): its recurrence (reference) and the chunked
PyTorch path (chunked), every device."""
