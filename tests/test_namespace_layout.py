import dataclasses

import pytest

from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")


def test_layout_sizes_and_slices():
    plane = 16 * 8 * 128 * 2
    assert LAYOUT.plane_bytes == plane
    assert LAYOUT.layer_bytes == 2 * plane
    assert LAYOUT.block_bytes == 4 * 2 * plane
    assert LAYOUT.layer_slice(2) == (2 * 2 * plane, 2 * plane)
    assert LAYOUT.plane_slice(2, 1) == (2 * 2 * plane + plane, plane)
    assert LAYOUT.layers_slice(1, 3) == (2 * plane, 4 * plane)
    mla = KVLayout(num_layers=2, num_kv_heads=1, head_dim=576, block_size=64, kv_planes=1)
    assert mla.block_bytes == 2 * 64 * 576 * 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_layers=0),
        dict(dtype="float64"),
        dict(kv_planes=3),
        dict(inner_order="XYZ"),
        dict(block_size=-16),
        dict(kv_planes=1.0),  # equal to 1, but it makes every size a float (and the digest another)
        dict(kv_planes=True),
        dict(num_layers=True),
    ],
)
def test_bad_layouts_are_rejected_with_the_field_named(kwargs):
    base = dict(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)
    with pytest.raises(InvalidArgument) as info:
        KVLayout(**{**base, **kwargs})
    assert any(name in str(info.value) for name in kwargs)


def test_layer_ranges_are_checked():
    with pytest.raises(InvalidArgument):
        LAYOUT.layer_slice(4)
    with pytest.raises(InvalidArgument):
        LAYOUT.plane_slice(0, 2)


def test_every_field_changes_the_namespace_digest():
    base = Namespace("llama-3-8b", LAYOUT, tp_rank=0, tp_size=2, tenant_salt="")
    variants = [
        dataclasses.replace(base, model_id="llama-3-70b"),
        dataclasses.replace(base, tp_rank=1),
        dataclasses.replace(base, tp_size=4),
        dataclasses.replace(base, pp_size=2),
        dataclasses.replace(base, tenant_salt="acme"),
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, dtype="float16")),
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, block_size=32)),
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, num_layers=5)),
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, num_kv_heads=4)),
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, head_dim=64)),
        dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, inner_order="HND")),
    ]
    digests = {base.digest} | {v.digest for v in variants}
    assert len(digests) == len(variants) + 1
    assert Namespace("llama-3-8b", LAYOUT, tp_rank=0, tp_size=2).digest == base.digest
    assert len(base.id) == 32


def test_bad_namespaces_are_rejected():
    with pytest.raises(InvalidArgument):
        Namespace("", LAYOUT)
    with pytest.raises(InvalidArgument):
        Namespace("m", LAYOUT, tp_rank=2, tp_size=2)


def test_bools_are_not_ranks_or_sizes():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    for fields in ({"tp_rank": False}, {"tp_size": True}, {"pp_rank": False, "pp_size": 1}):
        with pytest.raises(InvalidArgument):
            Namespace("m", layout, **fields)
