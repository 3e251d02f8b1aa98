import pytest
import torch

from kvstore.errors import TierUnavailable
from kvstore.hashing import chain_hashes
from kvstore.tier_kind import TierKind
from kvstore.tiers import device
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.hbm import HbmTier, HbmTierConfig

MiB = 1024 * 1024
META = BlockMeta(b"n" * 16, chain_hashes(list(range(16)), 16)[0], None, 65536)


def round_trip(tier):
    slot = tier.allocate(65536)
    data = torch.arange(65536, dtype=torch.int64).remainder(251).to(torch.uint8)
    tier.write(slot, data, META)
    out = torch.empty(65536, dtype=torch.uint8)
    tier.read(slot, out, META)
    assert torch.equal(out, data)
    assert tier.stats().num_blocks == 1


def test_hbm_slab_logic_on_a_cpu_tensor():
    tier = HbmTier(HbmTierConfig(capacity_bytes=4 * MiB, device="cpu", page_bytes=MiB))
    assert tier.kind is TierKind.HBM
    round_trip(tier)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on hosts without CUDA")
def test_hbm_tier_refuses_to_start_without_cuda():
    with pytest.raises(TierUnavailable, match="no usable CUDA device"):
        HbmTier(HbmTierConfig(capacity_bytes=MiB))
    assert device.pin_host_memory(torch.zeros(16, dtype=torch.uint8)) is False


@pytest.mark.gpu
def test_hbm_tier_on_a_real_gpu():
    tier = HbmTier(HbmTierConfig(capacity_bytes=64 * MiB, device="cuda:0", page_bytes=16 * MiB))
    assert tier.buffer.is_cuda
    round_trip(tier)


@pytest.mark.gpu
def test_host_memory_is_pinned_on_a_gpu_host():
    buffer = torch.zeros(4 * MiB, dtype=torch.uint8)
    assert device.pin_host_memory(buffer)
    device.unpin_host_memory(buffer)
