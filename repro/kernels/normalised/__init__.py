"""Causal linear attention's normalised product on feature maps: the differentiable path that
folds the normaliser into the causal product (attention), its bounded-workspace passes for the
layer's own autograd (blocked), the fused C layer (cpu_layer, linear_layer_cpu.c) and the fused
CUDA kernel (cuda). Its reference is the layer's unfused float64 formula in the tests."""
