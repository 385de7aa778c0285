"""The native CPU module `pyserve_kernels._cpu` (Rust, kernels/cpu), when built; the test for
whether a call can use it (float32 CPU tensors, C-contiguous); and, at import, pointing its
parallel kernels at the OpenMP team torch runs on (Linux, libgomp), so they use torch's
threads instead of starting their own (see kernels/cpu/src/parallel.rs for why)."""

from __future__ import annotations

import ctypes
import logging

import torch

try:
    from pyserve_kernels import _cpu
except ImportError:  # a source tree whose native module was never built
    _cpu = None

logger = logging.getLogger(__name__)


def native_available() -> bool:
    """Whether `pyserve_kernels._cpu` was built and imports."""
    return _cpu is not None


def native_applies(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels can take these tensors: module built, each float32 on CPU,
    C-contiguous, and not requiring grad (the kernels write through numpy views)."""
    return _cpu is not None and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and not t.requires_grad
        for t in tensors
    )


def as_int_array(t: torch.Tensor, dtype: torch.dtype, name: str):
    """A C-contiguous numpy view (or copy) of integer tensor `t` in `dtype` for the kernels.
    Raises ValueError for a non-integer tensor and IndexError for a value that `dtype` cannot
    hold (rather than letting a cast wrap it around)."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got {t.dtype}")
    if t.dtype != dtype and t.numel():
        info = torch.iinfo(dtype)
        low, high = int(t.min()), int(t.max())
        if low < info.min or high > info.max:
            raise IndexError(f"{name} holds {low if low < info.min else high}, outside {dtype}")
    return t.to(dtype).contiguous().numpy()


def _torch_libgomp() -> str | None:
    """Path of the one libgomp mapped into this process (torch's), or None (not Linux, no
    libgomp, e.g. an LLVM/Intel OpenMP build, or several copies)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    paths = {p for p in paths if p.startswith("/")}
    return paths.pop() if len(paths) == 1 else None


def _attach_openmp() -> None:
    path = _torch_libgomp() if _cpu is not None else None
    if path is None:
        return
    try:
        lib = ctypes.CDLL(path)  # the already-loaded copy: dlopen returns its handle
        addr = ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value
    except (OSError, AttributeError) as e:
        logger.debug("native kernels keep their own threads: %s", e)
        return
    if addr:
        _cpu._use_openmp(addr)


_attach_openmp()
