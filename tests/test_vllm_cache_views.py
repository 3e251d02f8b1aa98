"""The connector's copies over every cache layout vLLM 0.32 builds for GPU backends.

tests/vllm_cache_views.py runs in the vLLM venv: it takes each layer's view with vLLM's
own ``create_kv_cache_views`` for every ``KVCacheLayout``, full attention and MLA, and
checks that what kvstore stores is its planes and what it loads is the same bytes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from vllm_venv import require_vllm_venv

from bench.vllm_engine import VLLM_PYTHON

SCRIPT = Path(__file__).with_name("vllm_cache_views.py")

require_vllm_venv()


def test_every_kv_cache_layout_is_stored_as_kvstore_planes_and_loaded_back_byte_for_byte():
    run = subprocess.run([str(VLLM_PYTHON), str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cases = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    from_vllm = subprocess.run(
        [str(VLLM_PYTHON), "-c", "from vllm.v1.kv_cache_layout import KVCacheLayout; print(' '.join(l.name for l in KVCacheLayout))"],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout.split()
    assert len(from_vllm) >= 6
    assert {(case["layout"], case["spec"]) for case in cases} == {(name, spec) for name in from_vllm for spec in ("full attention", "mla")}
    assert all(case["ok"] for case in cases)
    # the views really are of several kinds: some blocks are not one contiguous run
    assert any(not case["block_contiguous"] for case in cases) and any(case["block_contiguous"] for case in cases)


def test_configurations_the_connector_cannot_serve_are_refused_with_a_sentence():
    script = SCRIPT.with_name("vllm_refusals.py")
    run = subprocess.run([str(VLLM_PYTHON), str(script)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cases = {case["case"]: case for case in map(json.loads, (line for line in run.stdout.splitlines() if line.startswith("{")))}
    accepted = {"accepted": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "mla": "bfloat16"}
    for name, dtype in accepted.items():
        assert cases[name]["refused"] is None and cases[name]["dtype"] == dtype, cases[name]
    said = {
        "per-token-head int8": "kv_cache_dtype='int8_per_token_head' is not supported",
        "nvfp4": "kv_cache_dtype='nvfp4' is not supported",
        "fp8 with skipped layers": "kv_cache_dtype_skip_layers",
        "pipeline parallel": "pipeline parallelism",
        "speculative decoding": "speculative decoding",
        "two KV cache groups": "2 groups",
        "async_load_tiers not a list": "async_load_tiers'] is a list of tiers",
        "async_load_tiers of an unknown tier": "async_load_tiers'] is a list of tiers",
        "async_load_tiers of lists": "async_load_tiers'] is a list of tiers",
        "lookup_hold_s too long": "lookup_hold_s must be a positive number of seconds, at most 600",
        "lookup_hold_s a flag": "lookup_hold_s must be a positive number of seconds",
        "defer_saves not a flag": "defer_saves'] must be true, false or null",
        "kv_cache_layout unknown": "kv_cache_layout'] is one of vLLM's KV cache layouts (LBHNC, LBNHC",
        "kv_cache_layout not a name": "kv_cache_layout'] is one of vLLM's KV cache layouts",
    }
    for name, words in said.items():
        sentence = cases[name]["refused"]
        assert sentence and words in sentence and sentence.endswith("."), (name, sentence)
    # kv_cache_layout is what the connector asks vLLM for; unset, it asks nothing
    assert (cases["layout BLHNC"]["asked"], cases["layout default"]["asked"]) == ("BLHNC", None)
