"""How the bytes of one KV block are laid out.

A block holds every layer of its ``block_size`` tokens, layer-major::

    [layer 0: K plane | V plane][layer 1: K | V] … [layer L-1: K | V]

Each plane is ``block_size × num_kv_heads × head_dim`` elements in the order named by
``inner_order`` (``"NHD"``: token, head, dim; ``"HND"``: head, token, dim). MLA models
store one latent plane per layer (``kv_planes=1``). Because layers are contiguous, a
layer slice of many blocks is a strided read and can be streamed while the forward pass
computes the next layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import InvalidArgument

__all__ = ["KVLayout", "DTYPE_SIZES"]

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}

_INNER_ORDERS = ("NHD", "HND")


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float16"
    kv_planes: int = 2
    inner_order: str = "NHD"

    def __post_init__(self) -> None:
        # ints only, not bools or floats: 1.0 == 1, but it would make every size a float
        # (a float nbytes breaks Stats) and give the same layout another digest
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise InvalidArgument(f"KVLayout.{name} must be a positive integer, got {value!r}.")
        if self.dtype not in DTYPE_SIZES:
            known = ", ".join(sorted(DTYPE_SIZES))
            raise InvalidArgument(f"KVLayout.dtype {self.dtype!r} is not one of: {known}.")
        if not _is_int(self.kv_planes) or self.kv_planes not in (1, 2):
            raise InvalidArgument(f"KVLayout.kv_planes must be 1 (MLA) or 2 (K and V), got {self.kv_planes!r}.")
        if self.inner_order not in _INNER_ORDERS:
            raise InvalidArgument(f"KVLayout.inner_order must be one of {_INNER_ORDERS}, got {self.inner_order!r}.")

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def plane_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def layer_bytes(self) -> int:
        return self.kv_planes * self.plane_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def layer_slice(self, layer: int) -> tuple[int, int]:
        """(offset, length) of one layer inside a block."""
        return self.layers_slice(layer, layer + 1)

    def layers_slice(self, first: int, stop: int) -> tuple[int, int]:
        """(offset, length) of layers ``first`` … ``stop - 1`` inside a block."""
        if not 0 <= first < stop <= self.num_layers:
            raise InvalidArgument(f"layer range [{first}, {stop}) is outside the block's {self.num_layers} layers.")
        return first * self.layer_bytes, (stop - first) * self.layer_bytes

    def plane_slice(self, layer: int, plane: int) -> tuple[int, int]:
        """(offset, length) of plane 0 (K, or the MLA latent) or 1 (V) of one layer."""
        if not 0 <= plane < self.kv_planes:
            raise InvalidArgument(f"plane {plane} does not exist in a layout with {self.kv_planes} plane(s).")
        offset, _ = self.layer_slice(layer)
        return offset + plane * self.plane_bytes, self.plane_bytes

    def describe(self) -> str:
        """The canonical text that identifies this layout inside a namespace digest."""
        return (
            f"layers={self.num_layers};heads={self.num_kv_heads};head_dim={self.head_dim};"
            f"block={self.block_size};dtype={self.dtype};planes={self.kv_planes};inner={self.inner_order}"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
