from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_HBM: Tier
TIER_HOST: Tier
TIER_NVME: Tier
TIER_REMOTE: Tier

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockHashes(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TierCount(_message.Message):
    __slots__ = ("tier", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    blocks: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., blocks: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "kv_planes", "inner_order")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_PLANES_FIELD_NUMBER: _ClassVar[int]
    INNER_ORDER_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    kv_planes: int
    inner_order: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_planes: _Optional[int] = ..., inner_order: _Optional[str] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("model_id", "layout", "tp_rank", "tp_size", "pp_rank", "pp_size", "tenant_salt")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    layout: KVLayout
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    tenant_salt: str
    def __init__(self, model_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., tenant_salt: _Optional[str] = ...) -> None: ...

class RegisterNamespaceResponse(_message.Message):
    __slots__ = ("namespace_id", "block_bytes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_bytes: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "token_ids", "block_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    token_ids: TokenIds
    block_hashes: BlockHashes
    def __init__(self, namespace_id: _Optional[bytes] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., block_hashes: _Optional[_Union[BlockHashes, _Mapping]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matched_blocks", "matched_tokens", "tiers", "tier_counts")
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TIER_COUNTS_FIELD_NUMBER: _ClassVar[int]
    matched_blocks: int
    matched_tokens: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    tier_counts: _containers.RepeatedCompositeFieldContainer[TierCount]
    def __init__(self, matched_blocks: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., tier_counts: _Optional[_Iterable[_Union[TierCount, _Mapping]]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "parent_hash", "payloads")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., payloads: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored",)
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    def __init__(self, num_stored: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("payloads",)
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, payloads: _Optional[_Iterable[bytes]] = ...) -> None: ...

class NodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "grpc_address", "transport_address", "kind")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    grpc_address: str
    transport_address: str
    kind: str
    def __init__(self, node_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., transport_address: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class NodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("namespace_id", "token_ids", "block_hashes", "node_ids")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    token_ids: TokenIds
    block_hashes: BlockHashes
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace_id: _Optional[bytes] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., block_hashes: _Optional[_Union[BlockHashes, _Mapping]] = ..., node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeMatch(_message.Message):
    __slots__ = ("node_id", "matched_blocks", "matched_tokens", "tier_counts")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_COUNTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    matched_blocks: int
    matched_tokens: int
    tier_counts: _containers.RepeatedCompositeFieldContainer[TierCount]
    def __init__(self, node_id: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., tier_counts: _Optional[_Iterable[_Union[TierCount, _Mapping]]] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeMatch]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeMatch, _Mapping]]] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("queued_tokens", "active_requests")
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    queued_tokens: int
    active_requests: int
    def __init__(self, queued_tokens: _Optional[int] = ..., active_requests: _Optional[int] = ...) -> None: ...

class RouteCandidate(_message.Message):
    __slots__ = ("node_id", "load")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    load: NodeLoad
    def __init__(self, node_id: _Optional[str] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("namespace_id", "token_ids", "session_id", "candidates")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    session_id: str
    candidates: _containers.RepeatedCompositeFieldContainer[RouteCandidate]
    def __init__(self, namespace_id: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., session_id: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[RouteCandidate, _Mapping]]] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("node_id", "expected_cached_tokens", "expected_cost_s", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_COST_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    expected_cached_tokens: int
    expected_cost_s: float
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., expected_cached_tokens: _Optional[int] = ..., expected_cost_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "num_blocks", "occupancy")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    occupancy: float
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., occupancy: _Optional[float] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "uptime_s", "tiers", "failed_tiers", "num_blocks", "num_namespaces", "num_leases", "num_reservations", "num_sessions", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    FAILED_TIERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    uptime_s: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    failed_tiers: _containers.RepeatedScalarFieldContainer[Tier]
    num_blocks: int
    num_namespaces: int
    num_leases: int
    num_reservations: int
    num_sessions: int
    counters: _containers.ScalarMap[str, int]
    def __init__(self, node_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., failed_tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., num_blocks: _Optional[int] = ..., num_namespaces: _Optional[int] = ..., num_leases: _Optional[int] = ..., num_reservations: _Optional[int] = ..., num_sessions: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class BlockInfo(_message.Message):
    __slots__ = ("namespace_id", "block_hash", "parent_hash", "tier", "nbytes", "age_s", "idle_s", "pinned", "leases")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hash: bytes
    parent_hash: bytes
    tier: Tier
    nbytes: int
    age_s: float
    idle_s: float
    pinned: bool
    leases: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., nbytes: _Optional[int] = ..., age_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., pinned: bool = ..., leases: _Optional[int] = ...) -> None: ...

class ListBlocksRequest(_message.Message):
    __slots__ = ("namespace_id", "tier", "min_idle_s", "page_size", "page_token")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MIN_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    tier: Tier
    min_idle_s: float
    page_size: int
    page_token: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., min_idle_s: _Optional[float] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListBlocksResponse(_message.Message):
    __slots__ = ("blocks", "next_page_token", "total")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    next_page_token: str
    total: int
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "tier", "min_idle_s", "all")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MIN_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tier: Tier
    min_idle_s: float
    all: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[Tier, str]] = ..., min_idle_s: _Optional[float] = ..., all: bool = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted", "skipped")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    skipped: int
    def __init__(self, evicted: _Optional[int] = ..., skipped: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("target_node_ids", "max_bytes")
    TARGET_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    target_node_ids: _containers.RepeatedScalarFieldContainer[str]
    max_bytes: int
    def __init__(self, target_node_ids: _Optional[_Iterable[str]] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("moved_blocks", "moved_bytes", "remaining_blocks", "sessions_moved", "blocks_by_peer")
    class BlocksByPeerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MOVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMAINING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_BY_PEER_FIELD_NUMBER: _ClassVar[int]
    moved_blocks: int
    moved_bytes: int
    remaining_blocks: int
    sessions_moved: int
    blocks_by_peer: _containers.ScalarMap[str, int]
    def __init__(self, moved_blocks: _Optional[int] = ..., moved_bytes: _Optional[int] = ..., remaining_blocks: _Optional[int] = ..., sessions_moved: _Optional[int] = ..., blocks_by_peer: _Optional[_Mapping[str, int]] = ...) -> None: ...

class WarmRequest(_message.Message):
    __slots__ = ("source_node_ids", "max_bytes")
    SOURCE_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    source_node_ids: _containers.RepeatedScalarFieldContainer[str]
    max_bytes: int
    def __init__(self, source_node_ids: _Optional[_Iterable[str]] = ..., max_bytes: _Optional[int] = ...) -> None: ...
