"""The few CUDA calls kvstore makes, behind one small module.

Everything else in kvstore works on tensors and never asks which device it runs on.
Where CUDA is absent (CI, CPU-only hosts) these functions report so instead of failing,
and the tiers that need a GPU refuse to start with a sentence that says why.
"""

from __future__ import annotations

import torch

from kvstore.errors import TierUnavailable

__all__ = ["cuda_available", "allocate_device_buffer", "pin_host_memory", "unpin_host_memory"]


def cuda_available() -> bool:
    return torch.cuda.is_available()


def allocate_device_buffer(nbytes: int, device: str) -> torch.Tensor:
    """A flat uint8 buffer of ``nbytes`` on ``device`` ("cuda:N", or "cpu" in tests)."""
    target = torch.device(device)
    if target.type == "cuda" and not cuda_available():
        raise TierUnavailable(f"the HBM tier asks for {device} but this host has no usable CUDA device.")
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=target)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        raise TierUnavailable(f"could not allocate {nbytes} bytes on {device}: {exc}; lower the HBM tier capacity.") from exc


def pin_host_memory(buffer: torch.Tensor) -> bool:
    """Page-lock a host buffer in place (cudaHostRegister) so GPU copies run at full DMA
    speed. Returns False, doing nothing, where CUDA is absent."""
    if not cuda_available():
        return False
    result = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
    return int(result) == 0


def unpin_host_memory(buffer: torch.Tensor) -> None:
    if cuda_available():
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
