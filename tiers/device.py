"""The few CUDA calls kvstore makes, behind one small module.

Everything else in kvstore works on tensors and never asks which device it runs on.
Where CUDA is absent (CI, CPU-only hosts) these functions report so instead of failing.

Who pins what: page-locking (``cudaHostRegister``) pins a process's *mapping* for that
process's CUDA context, so the host slab is pinned by each engine process that copies
between it and a GPU (the client does it on attach when asked, kvstore/client.py), and
never by the daemon: the daemon does no GPU copies, and a CUDA context of its own would
take GPU memory on the engines' device for nothing.
"""

from __future__ import annotations

import torch

__all__ = ["cuda_available", "pin_host_memory", "unpin_host_memory"]


def cuda_available() -> bool:
    return torch.cuda.is_available()


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
