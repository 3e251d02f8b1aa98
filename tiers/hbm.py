"""The HBM tier: the slab over a CUDA tensor.

Enabled only where CUDA is present; its logic is the same `MemoryTier` the host tier
uses, and tests exercise it on a CPU tensor (``device="cpu"``). Blocks reach it from an
engine on the same GPU without leaving the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.tier_kind import TierKind
from kvstore.tiers import device
from kvstore.tiers.memory import DEFAULT_PAGE_BYTES, MemoryTier

__all__ = ["HbmTierConfig", "HbmTier"]


@dataclass(frozen=True, slots=True)
class HbmTierConfig:
    capacity_bytes: int
    device: str = "cuda:0"
    page_bytes: int = DEFAULT_PAGE_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise InvalidArgument(f"HBM tier capacity_bytes must be a positive integer, got {self.capacity_bytes!r}.")


class HbmTier(MemoryTier):
    def __init__(self, config: HbmTierConfig) -> None:
        self.config = config
        super().__init__(TierKind.HBM, device.allocate_device_buffer(config.capacity_bytes, config.device), config.page_bytes)
