"""The CUDA calls kvstore makes (tiers/device.py): page-locking a host mapping."""

import pytest
import torch

from kvstore.tiers import device

MiB = 1024 * 1024


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on hosts without CUDA")
def test_pinning_is_a_no_op_without_cuda():
    assert device.pin_host_memory(torch.zeros(16, dtype=torch.uint8)) is False


@pytest.mark.gpu
def test_host_memory_is_pinned_on_a_gpu_host():
    buffer = torch.zeros(4 * MiB, dtype=torch.uint8)
    assert device.pin_host_memory(buffer)
    device.unpin_host_memory(buffer)
