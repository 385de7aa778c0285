"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def num_threads(request):
    """torch's intra-op threads set to 1, then 2 (the native kernels split rows over them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
