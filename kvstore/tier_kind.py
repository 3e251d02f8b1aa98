"""Where a block lives: the tier kinds every layer of kvstore names (tiers, the index, the
transport, the connectors, the API), fastest first."""

from __future__ import annotations

import enum

__all__ = ["TierKind", "TIER_BY_RANK"]


class TierKind(str, enum.Enum):
    """Where a block lives, fastest first. GPU is an engine's own prefix cache (reported by
    its KV events, never held by kvstore); REMOTE is a peer daemon's tier."""

    GPU = "gpu"
    HBM = "hbm"
    HOST = "host"
    NVME = "nvme"
    REMOTE = "remote"

    @property
    def rank(self) -> int:
        return _TIER_RANK[self]


_TIER_RANK = {TierKind.GPU: 0, TierKind.HBM: 1, TierKind.HOST: 2, TierKind.NVME: 3, TierKind.REMOTE: 4}
TIER_BY_RANK: tuple[TierKind, ...] = tuple(sorted(TierKind, key=_TIER_RANK.__getitem__))  # rank -> tier
