"""The CUDA backend: kernels generated as CUDA C, compiled with NVRTC."""
