"""Engine configurations the vLLM connector cannot serve are refused at start, with a sentence.

    .venv-vllm/bin/python tests/vllm_refusals.py

Run by test_vllm_cache_views with the vLLM venv's python: the connector's checks
(``check_supported``, ``engine_geometry``) over configurations that differ from one it
accepts in one field each. The configurations are plain objects with the fields the
checks read (building real ones needs a model on disk per case); prints one JSON line
per case with the refusal's sentence, or ``null`` for an accepted one; then the same
for ``kv_connector_extra_config`` values the connector refuses.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from kvstore.connectors.vllm import KVStoreConnector
from kvstore.connectors.vllm_compat import check_supported, engine_geometry
from kvstore.connectors.vllm_meta import ConnectorSettings
from kvstore.errors import InvalidArgument


def config(**changes):
    model = SimpleNamespace(
        model="/models/tiny",
        dtype="torch.bfloat16",
        use_mla=changes.pop("use_mla", False),
        hf_text_config=SimpleNamespace(kv_lora_rank=512),
        get_num_layers=lambda parallel: 2,
        get_num_kv_heads=lambda parallel: 2,
        get_head_size=lambda: 64,
    )
    cache = SimpleNamespace(
        block_size=32, cache_dtype=changes.pop("cache_dtype", "auto"), kv_cache_dtype_skip_layers=changes.pop("skip_layers", [])
    )
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=changes.pop("pp", 1))
    return SimpleNamespace(model_config=model, cache_config=cache, parallel_config=parallel, speculative_config=changes.pop("spec", None))


CASES = {
    "accepted": ({}, None),
    "fp8": ({"cache_dtype": "fp8"}, None),
    "fp8_e5m2": ({"cache_dtype": "fp8_e5m2"}, None),
    "mla": ({"use_mla": True}, None),
    "per-token-head int8": ({"cache_dtype": "int8_per_token_head"}, None),
    "nvfp4": ({"cache_dtype": "nvfp4"}, None),
    "fp8 with skipped layers": ({"cache_dtype": "fp8", "skip_layers": ["0"]}, None),
    "pipeline parallel": ({"pp": 2}, None),
    "speculative decoding": ({"spec": SimpleNamespace(method="eagle")}, None),
    "two KV cache groups": ({}, SimpleNamespace(kv_cache_groups=[object(), object()])),
}


# kv_connector_extra_config values the connector refuses (each alone)
SETTINGS = {
    "async_load_tiers not a list": {"async_load_tiers": "nvme"},
    "async_load_tiers of an unknown tier": {"async_load_tiers": ["gpu"]},
    "async_load_tiers of lists": {"async_load_tiers": [["nvme"]]},
    "lookup_hold_s too long": {"lookup_hold_s": 601},
    "lookup_hold_s a flag": {"lookup_hold_s": True},
    "defer_saves not a flag": {"defer_saves": "false"},
    "kv_cache_layout unknown": {"kv_cache_layout": "NHD"},
    "kv_cache_layout not a name": {"kv_cache_layout": 3},
}


def main() -> None:
    for name, (changes, kv_cache_config) in CASES.items():
        vllm_config = config(**changes)
        try:
            check_supported(vllm_config, kv_cache_config)
            geometry = engine_geometry(vllm_config, None)
            print(json.dumps({"case": name, "refused": None, "dtype": geometry.dtype}))
        except InvalidArgument as exc:
            print(json.dumps({"case": name, "refused": str(exc)}))
    for name, extra in SETTINGS.items():
        try:
            ConnectorSettings.from_extra_config(extra)
            print(json.dumps({"case": name, "refused": None}))
        except InvalidArgument as exc:
            print(json.dumps({"case": name, "refused": str(exc)}))
    # what the connector asks vLLM for: the layout named, else nothing (the backend's own)
    for layout in ("BLHNC", ""):
        transfer = SimpleNamespace(kv_connector_extra_config={"kv_cache_layout": layout} if layout else {})
        asked = KVStoreConnector.get_required_kvcache_layout(SimpleNamespace(kv_transfer_config=transfer))
        print(json.dumps({"case": f"layout {layout or 'default'}", "asked": asked}))


if __name__ == "__main__":
    sys.exit(main())
