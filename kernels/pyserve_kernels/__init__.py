"""pyserve-kernels: the op library of pyserve (import name `pyserve_kernels`).

Each op family has a slow fp32 torch reference in `reference.py`; faster launchers, when
present, are checked against these references. This package never imports pyserve.
"""

from pyserve_kernels.reference import apply_rotary_pos_emb, rms_norm, rotate_half, silu_and_mul

__version__ = "0.1.0"

__all__ = ["apply_rotary_pos_emb", "rms_norm", "rotate_half", "silu_and_mul", "__version__"]
