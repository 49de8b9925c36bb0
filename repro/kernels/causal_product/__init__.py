"""The causal dot product, out_i = sum_{j<=i} (q_i . k_j) v_j: its naive forms (reference), the
chunked PyTorch path (chunked), the fused C kernel (cpu_native, causal_dot_cpu.c) and the CuPy
CUDA kernels (cuda, causal_dot*.cu). repro.kernels.causal_dot_product picks among them."""
