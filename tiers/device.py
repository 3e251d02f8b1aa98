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

__all__ = ["cuda_available", "pin_host_memory", "unpin_host_memory", "on_device"]

# cudaHostRegisterPortable | cudaHostRegisterMapped: every context may copy from it, and
# kernels may read and write it in place (with unified addressing, at its host address)
_REGISTER_FLAGS = 1 | 2
_pinned: dict[int, int] = {}  # start address -> bytes of each range this process pinned


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pin_host_memory(buffer: torch.Tensor) -> bool:
    """Page-lock a host buffer in place (cudaHostRegister) so GPU copies run at full DMA
    speed and kernels can read it where it is (``on_device``). Returns False, doing
    nothing, where CUDA is absent."""
    if not cuda_available():
        return False
    nbytes = buffer.numel() * buffer.element_size()
    result = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, _REGISTER_FLAGS)
    if int(result) != 0:
        return False
    _pinned[buffer.data_ptr()] = nbytes
    return True


def unpin_host_memory(buffer: torch.Tensor) -> None:
    if cuda_available() and _pinned.pop(buffer.data_ptr(), None) is not None:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class _CudaArray:
    """``nbytes`` at ``address``, as the CUDA array interface describes device memory."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3, "strides": None}


def pinned_range_holds(address: int, nbytes: int) -> bool:
    """True when ``[address, address + nbytes)`` lies inside one range this process pinned."""
    return any(start <= address and address + nbytes <= start + length for start, length in _pinned.items())


def on_device(view: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor over the same bytes as the contiguous host ``view`` (zero-copy: kernels
    read and write the host memory across the bus), or None when the bytes are not in a
    range this process pinned, or the device cannot address pinned host memory at its
    host address (then the caller copies through the host instead). The tensor does not
    keep the memory alive: the caller must be done with it, synchronised, before the
    host memory is released."""
    if device.type != "cuda" or not view.is_contiguous():
        return None
    address, nbytes = view.data_ptr(), view.numel() * view.element_size()
    if not pinned_range_holds(address, nbytes) or not _host_pointers_usable(device):
        return None
    return torch.as_tensor(_CudaArray(address, nbytes), device=device)


_usable: dict[int, bool] = {}


def _host_pointers_usable(device: torch.device) -> bool:
    """Whether kernels on ``device`` reach pinned host memory at its host address
    (unified addressing with ``canUseHostPointerForRegisteredMem``): learned once by a
    kernel writing a pinned probe that the host then reads."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _usable:
        probe = torch.zeros(4096, dtype=torch.uint8)
        usable = False
        if pin_host_memory(probe):
            try:
                alias = torch.as_tensor(_CudaArray(probe.data_ptr(), probe.numel()), device=torch.device("cuda", index))
                alias.fill_(0x5A)
                torch.cuda.synchronize(index)
                usable = bool((probe == 0x5A).all())
            except RuntimeError:
                usable = False
            finally:
                unpin_host_memory(probe)
        _usable[index] = usable
    return _usable[index]
