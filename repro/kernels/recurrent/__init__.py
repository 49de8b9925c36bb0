"""One generation step of causal linear attention: the state and the torch step (step), the
fused CUDA step (cuda, recurrent_step.cu). Its reference is the parallel form on the same tokens."""
