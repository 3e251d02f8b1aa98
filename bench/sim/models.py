"""Model presets: how many bytes of KV a token costs, and how fast a replica works.

Every figure below is an assumption with its derivation; change a preset, not the code
that uses it. A *replica* is one 8-GPU node serving one model instance.

KV bytes per token (bf16, 2 bytes an element), from each model's published config:

- ``kimi-k2`` (Kimi K2, 1T-parameter MoE, 32B activated; DeepSeek V3's architecture with
  64 attention heads): MLA caches one compressed latent per layer and token —
  kv_lora_rank 512 + qk_rope_head_dim 64 = 576 elements — over 61 layers:
  61 × 576 × 2 B = 70,272 B ≈ 70 KB/token (a 512-token block: 36.0 MB).
- ``llama3-70b`` (GQA): 80 layers × 8 KV heads × 128 dims × 2 (K and V) × 2 B
  = 327,680 B = 320 KiB/token (a 512-token block: 168 MB).

Prefill rate (tokens/s at an empty context, one replica):

- kimi-k2: 32,000. DeepSeek's published V3/R1 inference overview (Feb 2025) reports
  73.7K input tokens/s per H800 node during prefill *including* on-disk cache hits, which
  were 56.3% of input tokens: 73.7K × 0.437 ≈ 32K computed tokens/s. An H200 has the
  H800's dense compute (989 TFLOPS bf16); K2 activates 32B parameters to V3's 37B, so this
  errs slow.
- llama3-70b: 20,000. FLOP-bound: 8 × 989e12 FLOP/s × 40% MFU / (2 × 70.6e9 FLOP/token)
  ≈ 22.4K, rounded down for the scheduler's overheads.

Attention: ``CostModel.prefill_s`` charges each new token (1 + context / A), A being the
context at which a token's attention FLOPs equal its linear FLOPs:
A = 2·activated_params / (layers × query_heads × 2·(qk_head_dim + v_head_dim)).
kimi-k2 (prefill runs MLA un-absorbed: qk 128 + 64 rope = 192, v 128, 64 heads):
64e9 / (61 × 64 × 640) ≈ 25.6K tokens. llama3-70b: 141.2e9 / (80 × 64 × 512) ≈ 53.9K.

Decode (seconds per output token of one request inside a running batch):
kimi-k2 0.05 (DeepSeek's same report: ~20-22 tokens/s per user while decoding);
llama3-70b 0.025 (TP8 H100 at moderate batch; an assumption in line with vendors'
published inter-token latencies of 20-30 ms).

Bandwidths, per replica:

- host → GPU: PCIe Gen5 x16 moves ~50 GB/s effective of its 64 GB/s. kimi-k2: 50 GB/s,
  one link's worth — an MLA latent is one head that every GPU serving the request needs
  whole, so more links do not split a block. llama3-70b: 200 GB/s — TP8 puts one KV head
  on each GPU, so a block's eight shards load in parallel, but an HGX board hangs two
  GPUs off each PCIe switch: four host uplinks × 50 GB/s.
- NVMe: 10 GB/s (two to four Gen4/Gen5 drives in a node read 6-12 GB/s in large I/Os).
- remote (a peer replica, over RDMA): 40 GB/s (one 400 Gb/s NIC ≈ 50 GB/s, ~80% of it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.index.scoring import CostModel
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

__all__ = ["ModelPreset", "PRESETS", "attention_context_tokens", "preset"]


def attention_context_tokens(activated_params: float, num_layers: int, num_query_heads: int, qk_head_dim: int, v_head_dim: int) -> float:
    """The context length at which a new token's attention FLOPs equal its linear FLOPs."""
    linear_flops = 2 * activated_params
    attention_flops_per_context_token = num_layers * num_query_heads * 2 * (qk_head_dim + v_head_dim)
    return linear_flops / attention_flops_per_context_token


@dataclass(frozen=True, slots=True)
class ModelPreset:
    name: str
    model_id: str
    # the KV layout of one block, as kvstore stores it (kvstore/layout.py)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_planes: int
    dtype: str
    prefill_tokens_per_s: float
    attention_context_tokens: float
    decode_s_per_token: float
    host_bytes_per_s: float
    nvme_bytes_per_s: float
    remote_bytes_per_s: float

    def layout(self, block_tokens: int) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, block_tokens, self.dtype, self.kv_planes)

    def namespace(self, block_tokens: int) -> Namespace:
        return Namespace(self.model_id, self.layout(block_tokens))

    @property
    def bytes_per_token(self) -> int:
        return self.layout(1).block_bytes

    def cost_model(self, remote_fetch: bool = True) -> CostModel:
        """The replica's speeds in kvstore's routing cost model. Decode runs as a concurrent
        batch that never delays a prefill in this simulator (engine.py), so a decoding
        request adds nothing to the queue here; the CLI then sets the load the router
        expects per decoding request (``--kvstore-decode-s-per-request``)."""
        return CostModel(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            attention_context_tokens=self.attention_context_tokens,
            host_bytes_per_s=self.host_bytes_per_s,
            nvme_bytes_per_s=self.nvme_bytes_per_s,
            remote_bytes_per_s=self.remote_bytes_per_s,
            decode_s_per_request=0.0,
            remote_fetch=remote_fetch,
        )


PRESETS: dict[str, ModelPreset] = {
    "kimi-k2": ModelPreset(
        name="kimi-k2",
        model_id="moonshotai/Kimi-K2-Instruct",
        num_layers=61,
        num_kv_heads=1,
        head_dim=512 + 64,
        kv_planes=1,
        dtype="bfloat16",
        prefill_tokens_per_s=32_000.0,
        attention_context_tokens=attention_context_tokens(32e9, 61, 64, 128 + 64, 128),
        decode_s_per_token=0.05,
        host_bytes_per_s=50e9,
        nvme_bytes_per_s=10e9,
        remote_bytes_per_s=40e9,
    ),
    "llama3-70b": ModelPreset(
        name="llama3-70b",
        model_id="meta-llama/Meta-Llama-3-70B-Instruct",
        num_layers=80,
        num_kv_heads=8,
        head_dim=128,
        kv_planes=2,
        dtype="bfloat16",
        prefill_tokens_per_s=20_000.0,
        attention_context_tokens=attention_context_tokens(70.6e9, 80, 64, 128, 128),
        decode_s_per_token=0.025,
        host_bytes_per_s=200e9,
        nvme_bytes_per_s=10e9,
        remote_bytes_per_s=40e9,
    ),
}


def preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidArgument(f"unknown model {name!r}; choose one of {sorted(PRESETS)}.") from None
