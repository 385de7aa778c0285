"""Host data to the device without making the host wait for the device.

A copy from pageable host memory to CUDA is synchronous: the host waits for the device's
queue to drain, so the worker could not launch step N+1 while step N runs. Staged through
pinned memory, the copy is queued on the current stream like a kernel. On CPU it is a plain
conversion. Worker thread (any thread that owns the current stream).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_device(data: Any, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """`data` (a list, numpy array or CPU tensor) as a `dtype` tensor on `device`; on CUDA
    staged in pinned memory and copied with non_blocking=True."""
    if isinstance(data, np.ndarray):
        host = torch.from_numpy(data)
    elif isinstance(data, torch.Tensor):
        host = data
    else:
        host = torch.tensor(data, dtype=dtype)
    same = host.dtype == dtype  # no conversion call (each torch call costs a GIL release)
    if device == "cpu" or torch.device(device).type == "cpu":
        return host if same else host.to(dtype)
    moved = host.pin_memory().to(device, non_blocking=True)
    return moved if same else moved.to(dtype)
