from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

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
    def __init__(self, ids: _Iterable[int] | None = ...) -> None: ...

class BlockHashes(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Iterable[bytes] | None = ...) -> None: ...

class TierCount(_message.Message):
    __slots__ = ("tier", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    blocks: int
    def __init__(self, tier: Tier | str | None = ..., blocks: int | None = ...) -> None: ...

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
    def __init__(
        self,
        num_layers: int | None = ...,
        num_kv_heads: int | None = ...,
        head_dim: int | None = ...,
        block_size: int | None = ...,
        dtype: str | None = ...,
        kv_planes: int | None = ...,
        inner_order: str | None = ...,
    ) -> None: ...

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
    def __init__(
        self,
        model_id: str | None = ...,
        layout: KVLayout | _Mapping | None = ...,
        tp_rank: int | None = ...,
        tp_size: int | None = ...,
        pp_rank: int | None = ...,
        pp_size: int | None = ...,
        tenant_salt: str | None = ...,
    ) -> None: ...

class RegisterNamespaceResponse(_message.Message):
    __slots__ = ("namespace_id", "block_bytes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_bytes: int
    def __init__(self, namespace_id: bytes | None = ..., block_bytes: int | None = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "token_ids", "block_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    token_ids: TokenIds
    block_hashes: BlockHashes
    def __init__(
        self,
        namespace_id: bytes | None = ...,
        token_ids: TokenIds | _Mapping | None = ...,
        block_hashes: BlockHashes | _Mapping | None = ...,
    ) -> None: ...

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
    def __init__(
        self,
        matched_blocks: int | None = ...,
        matched_tokens: int | None = ...,
        tiers: _Iterable[Tier | str] | None = ...,
        tier_counts: _Iterable[TierCount | _Mapping] | None = ...,
    ) -> None: ...

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
    def __init__(
        self,
        namespace_id: bytes | None = ...,
        block_hashes: _Iterable[bytes] | None = ...,
        parent_hash: bytes | None = ...,
        payloads: _Iterable[bytes] | None = ...,
    ) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored",)
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    def __init__(self, num_stored: int | None = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: bytes | None = ..., block_hashes: _Iterable[bytes] | None = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("payloads",)
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, payloads: _Iterable[bytes] | None = ...) -> None: ...

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
    def __init__(
        self, node_id: str | None = ..., grpc_address: str | None = ..., transport_address: str | None = ..., kind: str | None = ...
    ) -> None: ...

class NodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Iterable[NodeInfo | _Mapping] | None = ...) -> None: ...

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
    def __init__(
        self,
        namespace_id: bytes | None = ...,
        token_ids: TokenIds | _Mapping | None = ...,
        block_hashes: BlockHashes | _Mapping | None = ...,
        node_ids: _Iterable[str] | None = ...,
    ) -> None: ...

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
    def __init__(
        self,
        node_id: str | None = ...,
        matched_blocks: int | None = ...,
        matched_tokens: int | None = ...,
        tier_counts: _Iterable[TierCount | _Mapping] | None = ...,
    ) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeMatch]
    def __init__(self, nodes: _Iterable[NodeMatch | _Mapping] | None = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("queued_tokens", "active_requests")
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    queued_tokens: int
    active_requests: int
    def __init__(self, queued_tokens: int | None = ..., active_requests: int | None = ...) -> None: ...

class RouteCandidate(_message.Message):
    __slots__ = ("node_id", "load")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    load: NodeLoad
    def __init__(self, node_id: str | None = ..., load: NodeLoad | _Mapping | None = ...) -> None: ...

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
    def __init__(
        self,
        namespace_id: bytes | None = ...,
        token_ids: _Iterable[int] | None = ...,
        session_id: str | None = ...,
        candidates: _Iterable[RouteCandidate | _Mapping] | None = ...,
    ) -> None: ...

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
    def __init__(
        self,
        node_id: str | None = ...,
        expected_cached_tokens: int | None = ...,
        expected_cost_s: float | None = ...,
        reason: str | None = ...,
    ) -> None: ...

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
    def __init__(
        self,
        tier: Tier | str | None = ...,
        capacity_bytes: int | None = ...,
        used_bytes: int | None = ...,
        num_blocks: int | None = ...,
        occupancy: float | None = ...,
    ) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = (
        "node_id",
        "uptime_s",
        "tiers",
        "failed_tiers",
        "num_blocks",
        "num_namespaces",
        "num_leases",
        "num_reservations",
        "num_sessions",
        "counters",
        "problems",
    )
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: str | None = ..., value: int | None = ...) -> None: ...

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
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
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
    problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self,
        node_id: str | None = ...,
        uptime_s: float | None = ...,
        tiers: _Iterable[TierStats | _Mapping] | None = ...,
        failed_tiers: _Iterable[Tier | str] | None = ...,
        num_blocks: int | None = ...,
        num_namespaces: int | None = ...,
        num_leases: int | None = ...,
        num_reservations: int | None = ...,
        num_sessions: int | None = ...,
        counters: _Mapping[str, int] | None = ...,
        problems: _Iterable[str] | None = ...,
    ) -> None: ...

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
    def __init__(
        self,
        namespace_id: bytes | None = ...,
        block_hash: bytes | None = ...,
        parent_hash: bytes | None = ...,
        tier: Tier | str | None = ...,
        nbytes: int | None = ...,
        age_s: float | None = ...,
        idle_s: float | None = ...,
        pinned: bool = ...,
        leases: int | None = ...,
    ) -> None: ...

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
    def __init__(
        self,
        namespace_id: bytes | None = ...,
        tier: Tier | str | None = ...,
        min_idle_s: float | None = ...,
        page_size: int | None = ...,
        page_token: str | None = ...,
    ) -> None: ...

class ListBlocksResponse(_message.Message):
    __slots__ = ("blocks", "next_page_token", "total")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    next_page_token: str
    total: int
    def __init__(
        self, blocks: _Iterable[BlockInfo | _Mapping] | None = ..., next_page_token: str | None = ..., total: int | None = ...
    ) -> None: ...

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
    def __init__(
        self,
        namespace_id: bytes | None = ...,
        block_hashes: _Iterable[bytes] | None = ...,
        tier: Tier | str | None = ...,
        min_idle_s: float | None = ...,
        all: bool = ...,
    ) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted", "skipped")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    skipped: int
    def __init__(self, evicted: int | None = ..., skipped: int | None = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: bytes | None = ..., block_hashes: _Iterable[bytes] | None = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: int | None = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: bytes | None = ..., block_hashes: _Iterable[bytes] | None = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: int | None = ...) -> None: ...

class RetainRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "ttl_s")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    def __init__(
        self, namespace_id: bytes | None = ..., block_hashes: _Iterable[bytes] | None = ..., ttl_s: float | None = ...
    ) -> None: ...

class RetainResponse(_message.Message):
    __slots__ = ("found_blocks", "retained_blocks", "ttl_s")
    FOUND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    found_blocks: int
    retained_blocks: int
    ttl_s: float
    def __init__(self, found_blocks: int | None = ..., retained_blocks: int | None = ..., ttl_s: float | None = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "source_node_id")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    source_node_id: str
    def __init__(
        self, namespace_id: bytes | None = ..., block_hashes: _Iterable[bytes] | None = ..., source_node_id: str | None = ...
    ) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("host_blocks", "promoting_blocks", "missing_blocks", "fetching_blocks")
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMOTING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCHING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    host_blocks: int
    promoting_blocks: int
    missing_blocks: int
    fetching_blocks: int
    def __init__(
        self,
        host_blocks: int | None = ...,
        promoting_blocks: int | None = ...,
        missing_blocks: int | None = ...,
        fetching_blocks: int | None = ...,
    ) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("target_node_ids", "max_bytes")
    TARGET_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    target_node_ids: _containers.RepeatedScalarFieldContainer[str]
    max_bytes: int
    def __init__(self, target_node_ids: _Iterable[str] | None = ..., max_bytes: int | None = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("moved_blocks", "moved_bytes", "remaining_blocks", "sessions_moved", "blocks_by_peer")
    class BlocksByPeerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: str | None = ..., value: int | None = ...) -> None: ...

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
    def __init__(
        self,
        moved_blocks: int | None = ...,
        moved_bytes: int | None = ...,
        remaining_blocks: int | None = ...,
        sessions_moved: int | None = ...,
        blocks_by_peer: _Mapping[str, int] | None = ...,
    ) -> None: ...

class WarmRequest(_message.Message):
    __slots__ = ("source_node_ids", "max_bytes")
    SOURCE_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    source_node_ids: _containers.RepeatedScalarFieldContainer[str]
    max_bytes: int
    def __init__(self, source_node_ids: _Iterable[str] | None = ..., max_bytes: int | None = ...) -> None: ...

class CacheValueRequest(_message.Message):
    __slots__ = ("half_life_s",)
    HALF_LIFE_S_FIELD_NUMBER: _ClassVar[int]
    half_life_s: float
    def __init__(self, half_life_s: float | None = ...) -> None: ...

class CacheValueResponse(_message.Message):
    __slots__ = ("node_id", "value_bytes", "unique_bytes", "unique_blocks", "total_bytes", "total_blocks", "num_peers", "half_life_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PEERS_FIELD_NUMBER: _ClassVar[int]
    HALF_LIFE_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    value_bytes: float
    unique_bytes: int
    unique_blocks: int
    total_bytes: int
    total_blocks: int
    num_peers: int
    half_life_s: float
    def __init__(
        self,
        node_id: str | None = ...,
        value_bytes: float | None = ...,
        unique_bytes: int | None = ...,
        unique_blocks: int | None = ...,
        total_bytes: int | None = ...,
        total_blocks: int | None = ...,
        num_peers: int | None = ...,
        half_life_s: float | None = ...,
    ) -> None: ...
