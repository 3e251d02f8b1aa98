"""The engines' tokenizer in the router's own process (``[router] tokenizer``).

To route a request by its blocks the router needs the prompt's token ids as the engine
computes them. Without a tokenizer of its own it asks an engine's ``/tokenize`` for every
request: a round trip through an engine's API server on the request's critical path,
which a loaded host answers in tens of milliseconds. With ``tokenizer`` set to the
model's ``tokenizer.json`` (or the directory holding it), the router encodes a text
completion's prompt itself, as vLLM's completion endpoint does: the whole string, with
the tokenizer's special tokens unless the request sets ``add_special_tokens`` false.

A tokenizer file that differs from the engines' would route by wrong keys — never serve
wrong KV (the connectors key blocks from the engine's own tokens), but lose hits — so the
router keeps checking it against the engines:

- the first ``CHECK_FIRST`` prompts are tokenized both ways and routed by the engine's
  answer; the local tokenizer is used once all of them agree;
- then one prompt in ``CHECK_EVERY`` is sent to an engine's ``/tokenize`` as well, off the
  request's path, and every answer's ``usage.prompt_tokens`` is compared with the local
  count;
- at the first disagreement the router stops using it (until restarted), logs the first
  position where the two differ, and counts it (``kvstore_router_tokenizer_mismatches``).

Chat requests, batches of prompts, prompts given as token ids or embeddings, and a
request that asks the engine to truncate its prompt are tokenized as before (the engine's
chat template and options decide those tokens).

Owner: the router's event loop; not thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstore.config import ConfigError

__all__ = ["LocalTokenizer", "CHECK_FIRST", "CHECK_EVERY"]

log = logging.getLogger("kvstore.router")

CHECK_FIRST = 8  # prompts tokenized both ways before the local tokenizer is used
CHECK_EVERY = 64  # then one prompt in this many is checked against an engine
_CHECKING, _TRUSTED, _OFF = "checking", "trusted", "off"


class LocalTokenizer:
    """A text completion's token ids from the model's ``tokenizer.json``, checked against
    the engines (see the module's docstring)."""

    def __init__(self, path: str) -> None:
        file = Path(path).expanduser()
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(
                f"router.tokenizer must be the model's tokenizer.json or the directory holding it; {str(file)!r} is not a file."
            )
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ConfigError("router.tokenizer needs the tokenizers package: pip install 'kvstore[router]'.") from exc
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 (the library's own error types: a file it cannot read)
            raise ConfigError(f"router.tokenizer: {file} is not a tokenizer file the tokenizers package reads ({exc}).") from exc
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.path = str(file)
        self.state = _CHECKING
        self.agreed = 0  # prompts checked and found alike
        self._used = 0  # prompts tokenized here since it was trusted
        self.disagreement = ""  # why it is off

    # -- what it tokenizes ----------------------------------------------------------------
    @staticmethod
    def text_of(kind: str, payload: Mapping[str, Any]) -> tuple[str, bool] | None:
        """The prompt and its ``add_special_tokens`` when the request is a text completion
        of one prompt the engine tokenizes whole; None for anything else."""
        if kind != "completion" or payload.get("truncate_prompt_tokens") is not None or payload.get("prompt_embeds") is not None:
            return None
        prompt = payload.get("prompt")
        special = payload.get("add_special_tokens", True)
        if not isinstance(prompt, str) or not isinstance(special, bool):
            return None
        return prompt, special

    @property
    def usable(self) -> bool:
        return self.state != _OFF

    @property
    def trusted(self) -> bool:
        return self.state == _TRUSTED

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def check_due(self) -> bool:
        """Whether the prompt just tokenized here is one of those checked against an engine."""
        self._used += 1
        return self._used % CHECK_EVERY == 0

    # -- checks against the engines -------------------------------------------------------
    def compare(self, local: list[int], engine: list[int]) -> bool:
        """The engine's token ids for a prompt against the local ones: once ``CHECK_FIRST``
        prompts agree the local tokenizer is trusted; the first disagreement turns it off."""
        if self.state == _OFF:
            return False
        if local != engine:
            at = next((i for i, (a, b) in enumerate(zip(local, engine)) if a != b), min(len(local), len(engine)))
            self._turn_off(
                f"a prompt tokenized to {len(local)} tokens here and {len(engine)} by the engine, first differing at position {at} "
                f"(here {local[at:at + 4]}, the engine {engine[at:at + 4]})"
            )  # fmt: skip
            return False
        self.agreed += 1
        if self.state == _CHECKING and self.agreed >= CHECK_FIRST:
            self.state = _TRUSTED
            log.info(
                "router.tokenizer %s agreed with the engines on %d prompts: the router tokenizes text completions itself.",
                self.path,
                self.agreed,
            )
        return True

    def compare_count(self, local_count: int, engine_count: int) -> bool:
        """An answer's ``usage.prompt_tokens`` against the prompt's local token count."""
        if self.state == _OFF or local_count == engine_count:
            return self.state != _OFF
        self._turn_off(f"a prompt tokenized to {local_count} tokens here was {engine_count} tokens to the engine (its usage)")
        return False

    def _turn_off(self, why: str) -> None:
        self.state = _OFF
        self.disagreement = why
        log.warning(
            "router.tokenizer %s disagrees with the engines: %s. The router asks the engines' /tokenize from now on; "
            "point router.tokenizer at the engines' own tokenizer.json, or unset it.",
            self.path,
            why,
        )
