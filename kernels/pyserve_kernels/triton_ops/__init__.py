"""Triton kernels of pyserve (CUDA; tested on CPU under TRITON_INTERPRET=1). Import triton
lazily: this package is imported only when triton is available."""
