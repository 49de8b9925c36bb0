"""What every op folder of repro.kernels shares: the backend choice (backend), the CUDA variants'
switches (switches), the accumulation dtype (dtypes), host threads (threads), the C build and its
cache (cpu_build, cpu_blas.h), the CUDA build, launch geometry and launch path (cuda_build,
cuda_grid, cupy_launch, dtypes.cuh)."""
