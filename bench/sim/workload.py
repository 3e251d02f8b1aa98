"""What the simulator replays: requests whose prompts are chains of block keys.

A workload is an iterable of `Request`s in arrival order. Block keys are kvstore's own
16-byte chained hashes (so the production tier manager and index can be driven with
them); `block_tokens` says how many tokens one key stands for (512 in Mooncake traces).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.hashing import BlockHash

__all__ = ["Request"]


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    session_id: str
    block_hashes: tuple[BlockHash, ...]  # the prompt's full blocks, in chain order
    num_prompt_tokens: int  # may exceed len(block_hashes) * block_tokens by a partial block
    num_output_tokens: int
    block_tokens: int
