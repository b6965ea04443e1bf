"""Triton kernels (GPU). Each module imports triton itself; import them only where CUDA is used."""
