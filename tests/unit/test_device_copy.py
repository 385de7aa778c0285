"""Host data reaches the device as the asked dtype, from lists, numpy arrays and tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyserve.device_copy import to_device


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
def test_to_device_converts_every_host_form(device) -> None:
    for data in ([3, 1, 2], np.array([3, 1, 2], dtype=np.int32), torch.tensor([3, 1, 2], dtype=torch.int16)):
        t = to_device(data, torch.int64, device)
        assert t.dtype == torch.int64 and t.device.type == device
        assert t.cpu().tolist() == [3, 1, 2]
    f = to_device([[0.5, 1.0]], torch.float32, device)
    assert f.dtype == torch.float32 and f.cpu().tolist() == [[0.5, 1.0]]
