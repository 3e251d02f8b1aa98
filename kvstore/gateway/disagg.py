"""The bodies of prefill/decode disaggregation's two requests, as the vLLM connector's
``kv_producer`` and ``kv_consumer`` expect them (connectors/vllm_meta.py names the keys).

The prefill request is the client's, cut to one generated token, not streamed, with
``kv_transfer_params`` asking for a remote decode at the decode replica's daemon; the
decode request is the client's, untouched but for the ``kv_transfer_params`` the prefill
answered with (they name the handoff the decode side waits for).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["prefill_request", "decode_transfer_params", "TRANSFER_ID", "DESTINATION"]

# the connector's keys (kvstore.connectors.vllm_meta, which imports vLLM: not importable here)
TRANSFER_ID = "kvstore_transfer_id"
DESTINATION = "kvstore_destination"


def prefill_request(payload: Mapping[str, Any], transfer_id: str, destination: str) -> dict[str, Any]:
    body = {key: value for key, value in payload.items() if key not in ("stream", "stream_options", "n", "best_of")}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = {"do_remote_decode": True, TRANSFER_ID: transfer_id, DESTINATION: destination}
    return body


def decode_transfer_params(prefill_answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of the prefill replica's answer; None when it gave none
    (the decode replica then computes the prompt itself)."""
    try:
        params = json.loads(prefill_answer).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) else None
