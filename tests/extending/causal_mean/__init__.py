"""The causal mean, out_i = (1 / i) sum_{j<=i} v_j: the example op of docs/extending.md, "Adding a
kernel" (its reference and its PyTorch path)."""
