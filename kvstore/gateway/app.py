"""`kvstore router`: an OpenAI-compatible HTTP front door for engine replicas.

For each ``/v1/completions`` or ``/v1/chat/completions`` request the router

0. with API keys configured, lets in only a request that presents one, whose tenant is the
   key's (auth.py) and so are its sessions, and with ``salt_from_tenant`` sets its
   ``cache_salt`` to the tenant's;
1. checks it (size, JSON, every field it reads against the OpenAI API: validation.py,
   model) without touching an engine, and answers a malformed one with an OpenAI 400
   naming the field;
2. gets its token ids as the engine computes them (prompts.py) and hashes them into the
   chain of block keys of the engines' namespace (kvstore.hashing.chain_hashes, the
   function the connectors hash with), with its cache salt and LoRA adapter keyed as the
   engine keys them; a request with multimodal inputs is not hashed (prompts.py) and is
   routed by load and session alone ("unkeyed"), as is one for an adapter the replicas
   load from different paths;
3. asks the block-location index which replica holds how much of the chain, in which
   tier, and lets the production cost model (kvstore.router.Router over
   kvstore.index.scoring) choose, with the load the router tracks, each replica's cache
   size against the live sessions placed there (index/live.py) and the session's
   affinity (kept in the index backend, so router replicas agree), among the replicas
   that serve the request's model (an adapter only where it is loaded). On one host
   without Redis (``router.index = "daemons"``) the index is the replicas' daemons, asked
   over gRPC (index/daemons.py), and the sessions live in this router's memory;
4. forwards the body untouched (but for the tenant's salt) and streams the answer back
   chunk by chunk; an engine's 4xx is answered as an OpenAI error naming the client's
   field (openai_errors.py), never as the engine's dump;
5. remembers the chain under the request's tenant label, for the cache bytes held per
   tenant that a background task measures against the index (tenant_cache.py).

A replica that refuses the connection, times out before its first byte, or answers 5xx
is excluded and the request routed again, at most ``max_attempts`` replicas in all; the
session moves with the failure named in the recorded reason. Once a byte has gone to the
client the answer is the engine's, whatever happens.

On SIGHUP the router re-reads its configuration file and adopts its replica list
(reload.py): a replica joins, or leaves, without a restart.

Owner: one asyncio event loop (uvicorn's); nothing here is shared across threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import xxhash
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvstore.config import index_config_for
from kvstore.errors import KVStoreError
from kvstore.gateway.auth import presented_key, tenant_salt
from kvstore.gateway.config import DAEMONS_INDEX, RouterConfig
from kvstore.gateway.disagg import decode_transfer_params, prefill_request
from kvstore.gateway.metrics import RouterMetrics
from kvstore.gateway.misses import RouteView, SeenBlocks, attribute
from kvstore.gateway.openai_errors import engine_error, openai_error
from kvstore.gateway.prompts import (
    BadRequest,
    LoraAdapter,
    block_extra_keys,
    prompt_token_ids,
    session_of,
    tokenize_request,
    tokens_digest,
    unkeyed_inputs,
)
from kvstore.gateway.reload import ConfigReload
from kvstore.gateway.replicas import Replica, ReplicaSet
from kvstore.gateway.retention import SessionRetention
from kvstore.gateway.scaledown import drain_plan_route
from kvstore.gateway.session_log import Answer, SessionLog, Turn, answer_digest
from kvstore.gateway.tenant_cache import RecentChains, TenantCache
from kvstore.gateway.tokenizer import LocalTokenizer
from kvstore.gateway.validation import validate_request
from kvstore.hashing import chain_hashes
from kvstore.index.backends import open_index
from kvstore.index.base import Index, SessionStore
from kvstore.index.daemons import DaemonAddress, DaemonCalls, DaemonsIndex
from kvstore.index.live import LiveSessions
from kvstore.index.scoring import Candidate, RouteDecision
from kvstore.index.sessions import EmbeddedSessionStore
from kvstore.router import Router

__all__ = ["Gateway", "build_app", "openai_error"]

_USAGE_TAIL_BYTES = 16 * 1024  # the end of a stream, where the usage chunk is
_PASSED_REQUEST_HEADERS = ("authorization", "content-type", "accept")
_UNAUTHORIZED = "Incorrect or missing API key: send the key this router gave you as 'Authorization: Bearer KEY' (or 'x-api-key: KEY')."


@dataclass(slots=True)
class _Routed:
    replica: Replica
    decision: RouteDecision
    upstream: httpx.Response
    started: float
    prefill_node_id: str = ""  # prefill/decode disaggregation: where the prompt was computed
    prefilling_tokens: int | None = None  # a streamed answer's uncached prompt tokens, in the queue until its first chunk
    tokenized_here: int | None = None  # the prompt's token count where the router tokenized it (router.tokenizer)
    held: tuple[int, int] = (0, 0)  # the prompt's leading blocks the chosen replica held, and the most another held
    accounting: _Accounting | None = None  # what its miss attribution and the session log need (keyed requests)
    unkeyed: bool = False  # routed without block keys (multimodal inputs): its computed tokens' cause is not known
    retained: bool = False  # a session's turn whose chain its replica keeps through the pause (retention.py)

    def prefilled(self) -> bool:
        """The replica has computed the prompt: its tokens leave the replica's queue (once;
        True the time they do)."""
        if self.prefilling_tokens is None:
            return False
        self.replica.prefilled(self.prefilling_tokens)
        self.prefilling_tokens = None
        return True


@dataclass(slots=True)
class _Accounting:
    """A keyed request's prompt as routed: what its answer's usage is attributed against
    (misses.py) and the session's turn it is (session_log.py)."""

    view: RouteView
    tenant: str
    hashes: list
    token_ids: list[int]
    session_id: str = ""
    turn: Turn | None = None
    answer: _AnswerText | None = None  # a session's chat answer, read as it streams


class _AnswerText:
    """A streamed chat answer's text and tool calls, from its SSE events as they pass: the
    session log compares it with what the client sends back next turn."""

    def __init__(self) -> None:
        self._pending = b""
        self._content: list[str] = []
        self._calls: dict[int, list[str]] = {}  # index -> [name, arguments]

    def feed(self, chunk: bytes) -> None:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if line.startswith(b"data: {"):
                try:
                    event = json.loads(line[6:])
                except ValueError:
                    continue
                for choice in event.get("choices") or ():
                    self._delta(choice.get("delta") or {})

    def _delta(self, delta: dict) -> None:
        if isinstance(delta.get("content"), str):
            self._content.append(delta["content"])
        for call in delta.get("tool_calls") or ():
            entry = self._calls.setdefault(call.get("index", 0), ["", ""])
            function = call.get("function") or {}
            entry[0] += function.get("name") or ""
            entry[1] += function.get("arguments") or ""

    def digest(self) -> int:
        calls = [{"function": {"name": name, "arguments": arguments}} for _, (name, arguments) in sorted(self._calls.items())]
        return answer_digest("".join(self._content), calls)


class _NoReplica(Exception):
    pass


class Gateway:
    def __init__(self, config: RouterConfig, load: Callable[[], RouterConfig] | None = None) -> None:
        """``load`` reads the configuration again, on SIGHUP (reload.py)."""
        self.config = config
        self.metrics = RouterMetrics([r.node_id for r in config.replicas], config.max_tenants)
        self.replicas = ReplicaSet.of(config.replicas, self.metrics)
        self.reload = ConfigReload(load, self.replicas, self.metrics)
        self.index, self.sessions = self._open_index(config)
        self.router = Router(None, self.index, self.sessions, config.routing)
        self.live = LiveSessions(config.routing.session_ttl_s, config.namespace.block_size)  # what each replica must keep
        recent = RecentChains(config.tenant_cache_chains, config.tenant_cache_blocks)
        self.tenant_cache = TenantCache(recent, self.index, config.namespace, self.metrics)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.first_byte_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
        )
        self.tokenizer = LocalTokenizer(config.tokenizer) if config.tokenizer else None
        self.seen = SeenBlocks(config.seen_blocks)  # the chains the fleet computed: what a miss was evicted from
        self.session_log = SessionLog(config.session_log_sessions)
        calls = self.index.calls if isinstance(self.index, DaemonsIndex) else DaemonCalls(config.daemon_timeout_s)
        count = lambda call, outcome: self.metrics.retention_calls.labels(call, outcome).inc()  # noqa: E731
        self.retention = SessionRetention(config.retention, calls, self._daemons_by_node, config.session_log_sessions, count)
        self._tasks: list[asyncio.Task] = []
        self._reload_checks: set[asyncio.Task] = set()
        self._tokenizer_checks: set[asyncio.Task] = set()

    def _open_index(self, config: RouterConfig) -> tuple[Index, SessionStore]:
        if config.index != DAEMONS_INDEX:
            return open_index(index_config_for(config.index))  # rediss://: the TLS files and ACL user a daemon's variables name
        # the daemons of the replicas listed now: a reload's new list is asked from then on
        return DaemonsIndex(self._daemons, config.daemon_timeout_s), EmbeddedSessionStore()

    def _daemons(self) -> list[DaemonAddress]:
        return [DaemonAddress(r.node_id, r.daemon, r.daemon_token) for r in self.config.replicas]

    def _daemons_by_node(self) -> dict[str, DaemonAddress]:
        """The replicas' daemons that are named (retention's calls go to them)."""
        return {r.node_id: DaemonAddress(r.node_id, r.daemon, r.daemon_token) for r in self.config.replicas if r.daemon}

    # -- lifecycle -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        await self.replicas.check(self.client, self.config.connect_timeout_s)
        self._tasks = [
            asyncio.create_task(self.replicas.run_checks(self.client, self.config.health_interval_s, self.config.connect_timeout_s)),
            asyncio.create_task(self.tenant_cache.run(self.config.tenant_cache_interval_s)),
        ]
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self._on_hangup)
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
            for task in (*self._reload_checks, *self._tokenizer_checks, *self._tasks):
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.client.aclose()
            await self.index.close()
            if not isinstance(self.index, DaemonsIndex):
                await self.retention.close()

    def _on_hangup(self) -> None:
        """SIGHUP: adopt the file's replica list, and check the replicas now rather than at
        the next interval, so that a joining one enters rotation as soon as it answers."""
        self.config = self.reload(self.config)
        task = asyncio.get_running_loop().create_task(self.replicas.check(self.client, self.config.connect_timeout_s))
        self._reload_checks.add(task)
        task.add_done_callback(self._reload_checks.discard)

    # -- endpoints ------------------------------------------------------------------------
    async def health(self, _request: Request) -> Response:
        healthy = [r.node_id for r in self.replicas.healthy()]
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "no healthy replica", "healthy_replicas": healthy}, status_code=status)

    async def models(self, request: Request) -> Response:
        if self._tenant(request) is None:
            return _unauthorized()
        models = sorted(self.replicas.models())
        if not models:
            return openai_error(503, "No engine replica is healthy; the router has no model to serve.", "service_unavailable")
        return JSONResponse({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "kvstore-router"} for m in models]})

    async def session_list(self, request: Request) -> Response:
        """``GET /kvstore/sessions``: the sessions the router keeps, most recent first, with
        their turns, tokens and divergences (session_log.py). With API keys, the presenting
        key's tenant's alone; without, every tenant's (``?tenant=`` for one)."""
        tenant, allowed = self._reader(request)
        if not allowed:
            return _unauthorized()
        return JSONResponse({"sessions": self.session_log.sessions(tenant)})

    async def session_show(self, request: Request) -> Response:
        """``GET /kvstore/sessions/{id}``: one session's turns — where each diverged from the
        one before, the token ids around the point, and (``router.session_text``) their text."""
        tenant, allowed = self._reader(request)
        if not allowed:
            return _unauthorized()
        session_id = request.path_params["session_id"]
        named = [session_id, f"h:{session_id}"]  # as listed, or as the client named it in its session header
        if tenant and self.config.api_keys:  # the tenant's own id
            named += [f"{tenant}/{session_id}", f"{tenant}/h:{session_id}"]
        found = next((s for s in (self.session_log.session(n, tenant) for n in named) if s is not None), None)
        if found is None:
            message = f"The router keeps no session {session_id!r} (unknown, or forgotten: it keeps the latest ones)."
            return openai_error(404, message, code="not_found")
        if self.config.session_text:
            for turn in found["turns"]:
                divergence = turn.get("divergence")
                if divergence:
                    divergence["before_text"] = await self._decode(divergence["before"])
                    divergence["after_text"] = await self._decode(divergence["after"])
        return JSONResponse(found)

    def _reader(self, request: Request) -> tuple[str | None, bool]:
        """Whose sessions a reader of the session log sees: (its tenant, allowed). With API
        keys, the key's tenant; without, the ``tenant`` query parameter (None: all)."""
        if self.config.api_keys:
            tenant = self._tenant(request)
            return tenant, tenant is not None
        return request.query_params.get("tenant") or None, True

    async def _decode(self, token_ids: list[int]) -> str | None:
        """Token ids as text: by the router's tokenizer, else an engine's /detokenize (None when none answers)."""
        if self.tokenizer is not None:
            return self.tokenizer.decode(token_ids)
        for replica in self.replicas.healthy():
            model = next(iter(replica.models), None)
            if model is None:
                continue
            try:
                answer = await self.client.post(f"{replica.config.url}/detokenize", json={"model": model, "tokens": token_ids})
            except httpx.HTTPError:
                continue
            if answer.status_code == 200:
                text = answer.json().get("prompt")
                return text if isinstance(text, str) else None
        return None

    async def prometheus(self, _request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion", "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat", "/v1/chat/completions")

    # -- the request path -----------------------------------------------------------------
    async def _serve(self, request: Request, kind: str, path: str) -> Response:
        arrived = time.monotonic()
        tenant = self._tenant(request)
        if tenant is None:
            self.metrics.requests.labels("none", "401").inc()
            return _unauthorized()
        try:
            body, payload = await self._read(request, kind)
            read = time.monotonic()
            self.metrics.overhead.labels("read").observe(read - arrived)
            if self.config.salt_from_tenant:  # the tenant's, whatever the client sent: no block is keyed alike for two tenants
                payload["cache_salt"] = tenant_salt(self.config.salt_secret, tenant)
                body = json.dumps(payload).encode()
            stream = payload.get("stream") is True
            model = payload["model"]
            unkeyed = unkeyed_inputs(kind, payload)  # its tokens alone would be a wrong key: not asked for
            token_ids, tokenized_here = ([], False) if unkeyed else await self._token_ids(kind, payload, request)
            adapter, unkeyed = (None, unkeyed) if unkeyed else self._adapter(model)
            block_size = self.config.namespace.block_size
            extra_keys = block_extra_keys(payload, len(token_ids) // block_size, adapter)
            hashes = [] if unkeyed else chain_hashes(token_ids, block_size, extra_keys=extra_keys)
            self.metrics.overhead.labels("tokenize").observe(time.monotonic() - read)
            session = session_of(request.headers, self.config.session_header, kind, payload, hashes, self.config.session_prefix_blocks)
            if session is not None and self.config.api_keys:  # the tenant's own: another naming its id neither joins nor moves it
                session = dataclasses.replace(session, session_id=f"{tenant}/{session.session_id}")
        except BadRequest as exc:
            self.metrics.requests.labels("none", str(exc.status)).inc()
            return openai_error(exc.status, exc.message, param=exc.param, code=exc.code)
        except _Upstream as exc:
            self.metrics.requests.labels("none", str(exc.response.status_code)).inc()
            return exc.translated(kind, payload)
        except _NoReplica as exc:
            self.metrics.requests.labels("none", "503").inc()
            return openai_error(503, str(exc), "service_unavailable")
        headers = self._engine_headers(request, _PASSED_REQUEST_HEADERS)
        try:
            session_id = session.session_id if session else ""
            if self.replicas.disaggregated():
                routed = await self._disaggregated(path, payload, headers, token_ids, hashes, session_id, tenant, unkeyed)
            else:
                # a session the client names, or a chat's: kept on its replica through its pauses
                retained = session is not None and (session.source != "derived" or kind == "chat")
                routed = await self._send(
                    path, body, headers, token_ids, hashes, session_id, model=model, unkeyed=unkeyed, streamed=stream, retained=retained
                )
                routed.retained = retained
                self.metrics.overhead.labels("total").observe(routed.started - arrived)
                if tokenized_here:
                    routed.tokenized_here = len(token_ids)
                if hashes:
                    routed.accounting = self._account(routed, tenant, session_id, kind, token_ids, hashes, payload, stream)
                routed.unkeyed = bool(unkeyed)
        except _NoReplica as exc:
            self.metrics.requests.labels("none", "503").inc()
            return openai_error(503, str(exc), "service_unavailable")
        except _Upstream as exc:  # the prefill replica's own 4xx
            return exc.translated(kind, payload)
        except KVStoreError as exc:  # the index or session store cannot answer
            self.metrics.requests.labels("none", "503").inc()
            return openai_error(503, f"The router cannot reach its index: {exc}", "service_unavailable")
        self.tenant_cache.recent.record(self.metrics.tenants.label(tenant), hashes)
        info = {
            "x-kvstore-replica": routed.replica.node_id,
            "x-kvstore-route": _reason_kind(routed.decision.reason),
            "x-kvstore-expected-cached-tokens": str(routed.decision.expected_cached_tokens),
        }
        if token_ids:
            info["x-kvstore-prompt-tokens"] = str(len(token_ids))
            info["x-kvstore-prompt-digest"] = tokens_digest(token_ids)
        if unkeyed:
            info["x-kvstore-unkeyed"] = unkeyed
        if session is not None:
            info["x-kvstore-session"] = session.session_id
        if routed.prefill_node_id:
            info["x-kvstore-prefill-replica"] = routed.prefill_node_id
        self.metrics.expected_cached_tokens.labels(routed.replica.node_id).inc(routed.decision.expected_cached_tokens)
        if stream and routed.upstream.status_code == 200:
            return StreamingResponse(
                self._relay(routed, tenant), routed.upstream.status_code, info, media_type=routed.upstream.headers.get("content-type")
            )
        try:
            content = await routed.upstream.aread()
        except httpx.HTTPError as exc:  # it failed after answering: too late to send the request elsewhere
            self.metrics.requests.labels(routed.replica.node_id, "502").inc()
            message = f"The replica {routed.replica.node_id} failed while answering ({type(exc).__name__}); retry the request."
            return openai_error(502, message, "upstream_error")
        finally:
            await routed.upstream.aclose()
            self._finish(routed)
        in_session = routed.accounting is not None and routed.accounting.turn is not None  # its answer is the session's
        usage, answer = _usage_and_answer(content, in_session)
        self._observe(routed, tenant, stream=False, usage=usage, answer=answer)
        if 400 <= routed.upstream.status_code < 500:
            return engine_error(routed.upstream.status_code, content, kind, payload, info)
        return Response(content, routed.upstream.status_code, info, media_type=routed.upstream.headers.get("content-type"))

    async def _read(self, request: Request, kind: str) -> tuple[bytes, dict[str, Any]]:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"The request body of {int(declared):,} bytes exceeds the router's limit of {limit:,} bytes.", status=413)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BadRequest(f"The request body exceeds the router's limit of {limit:,} bytes.", status=413)
                chunks.append(chunk)
        except ClientDisconnect as exc:
            raise BadRequest("The client went away before sending the whole body.") from exc
        body = b"".join(chunks)
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"The request body is not valid JSON: {exc}.") from exc
        if not isinstance(payload, dict):
            raise BadRequest("The request body must be a JSON object.")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("'model' is required: one of the models /v1/models lists.", "model")
        validate_request(kind, payload)
        served = self.replicas.models()
        if not served:
            raise _NoReplica("No engine replica is healthy; retry once one is back.")
        if model not in served:
            raise BadRequest(
                f"The model {model!r} does not exist here; this router serves {', '.join(sorted(served))}.", "model", 404, "model_not_found"
            )
        return body, payload

    def _adapter(self, model: str) -> tuple[LoraAdapter | None, str]:
        """The LoRA adapter ``model`` names, as every healthy replica serving it loads it
        (None for a base model); or why the request cannot be keyed: the replicas load it
        from different paths, or do not all serve it as an adapter."""
        paths = self.replicas.adapter_paths(model)
        if paths <= {None}:
            return None, ""
        path = paths.pop() if len(paths) == 1 else None
        if not path:
            return None, f"the replicas serving {ascii(model[:80])} do not agree on its LoRA adapter's path"
        return LoraAdapter(model, path), ""

    async def _token_ids(self, kind: str, payload: dict[str, Any], request: Request) -> tuple[list[int], bool]:
        """The prompt's token ids as the engine computes them, and whether the router's own
        tokenizer gave them (router.tokenizer, tokenizer.py; checked against the engines)."""
        given = prompt_token_ids(kind, payload)
        if given is not None:
            return given, False
        local = self.tokenizer
        text = LocalTokenizer.text_of(kind, payload) if local is not None and local.usable else None
        if local is None or text is None:
            self.metrics.tokenized.labels("engine").inc()
            return await self._engine_token_ids(kind, payload, request), False
        mine = local.encode(*text)
        if not local.trusted:  # still checking it: the engine's answer routes
            theirs = await self._engine_token_ids(kind, payload, request)
            self.metrics.tokenized.labels("engine").inc()
            if not local.compare(mine, theirs):
                self.metrics.tokenizer_mismatches.inc()
            return theirs, False
        if local.check_due():
            task = asyncio.get_running_loop().create_task(self._check_tokens(mine, kind, payload, request))
            self._tokenizer_checks.add(task)
            task.add_done_callback(self._tokenizer_checks.discard)
        self.metrics.tokenized.labels("router").inc()
        return mine, True

    async def _check_tokens(self, mine: list[int], kind: str, payload: dict[str, Any], request: Request) -> None:
        """One prompt the router tokenized, checked against an engine off the request's path."""
        try:
            theirs = await self._engine_token_ids(kind, payload, request)
        except (_Upstream, _NoReplica, httpx.HTTPError, ValueError):
            return  # no engine answered: checked with a later prompt
        if self.tokenizer is not None and not self.tokenizer.compare(mine, theirs):
            self.metrics.tokenizer_mismatches.inc()

    async def _engine_token_ids(self, kind: str, payload: dict[str, Any], request: Request) -> list[int]:
        tokenize = tokenize_request(kind, payload)
        headers = self._engine_headers(request, ("authorization",))
        for replica in self.replicas.healthy(payload["model"]):  # only those know an adapter's name
            try:
                response = await self.client.post(f"{replica.config.url}/tokenize", json=tokenize, headers=headers)
            except httpx.TransportError as exc:
                self.replicas.mark_down(replica, f"/tokenize failed: {type(exc).__name__}")
                continue
            if response.status_code >= 500:
                continue
            if response.status_code != 200:
                raise _Upstream(response, replica.node_id)  # the engine's own sentence about what is wrong with the prompt
            tokens = response.json().get("tokens")
            if not isinstance(tokens, list):
                continue
            return tokens
        raise _NoReplica("No engine replica could tokenize the prompt; retry once one is healthy.")

    async def _send(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        token_ids: list[int],
        hashes,
        session_id: str,
        roles: tuple[str, ...] = ("both", "prefill", "decode"),
        excluded: set[str] | None = None,
        model: str | None = None,
        unkeyed: str = "",
        streamed: bool = False,
        retained: bool = False,
    ) -> _Routed:
        """Route and send the request, retrying elsewhere on a failure before its answer
        starts. Its uncached tokens are in the replica's queue until the engine answers —
        for a ``streamed`` request, until its first chunk (`_relay`): vLLM sends a stream's
        headers at once and its first token once the prompt is computed."""
        ns = self.config.namespace
        excluded = set() if excluded is None else excluded
        failures: list[str] = []
        for _attempt in range(self.config.max_attempts):
            asked = [c.node_id for c in self.replicas.candidates(excluded, roles, model)]
            if not asked:
                break
            asking = time.monotonic()
            lookup = await self.router.look_up(ns.digest, hashes, asked, session_id)
            self.metrics.overhead.labels("lookup").observe(time.monotonic() - asking)
            # the load as it is now, after the index's answer: from here to the increments
            # below nothing awaits, so a concurrent request decides with this one counted
            members = dict(self.replicas.replicas)  # and a reload while a request is sent must not lose its replica
            now = time.monotonic()
            candidates = [self._with_cache(c, members, now) for c in self.replicas.candidates(excluded, roles, model) if c.node_id in asked]
            if not candidates:
                break
            notes = [f"retry after {'; '.join(failures)}" if failures else "", f"unkeyed: {unkeyed}" if unkeyed else ""]
            note = "; ".join(n for n in notes if n)
            decision = self.router.decide(lookup, candidates, len(token_ids), ns.block_size, ns.block_bytes, session_id, note)
            if hashes:
                self.live.record(session_id, decision.node_id, hashes, len(token_ids), now)
                if retained:  # its chain brought back to the replica while the request is on its way
                    self.retention.turn_routed(session_id, decision.node_id, ns.digest, hashes, now)
            replica = members[decision.node_id]
            uncached = max(len(token_ids) - decision.expected_cached_tokens, 0)
            replica.sent(uncached)
            self.replicas.publish_load(replica)
            kind = _reason_kind(decision.reason)
            self.metrics.decisions.labels(kind).inc()
            if decision.moved_from is not None:
                self.metrics.session_moves.labels(kind).inc()
            remembering = time.monotonic()
            try:
                await self.router.remember(session_id, decision)
            except BaseException:
                self._release(replica, uncached)
                raise
            started = time.monotonic()
            self.metrics.overhead.labels("remember").observe(started - remembering)
            try:
                upstream = await self.client.send(
                    self.client.build_request("POST", f"{replica.config.url}{path}", content=body, headers=headers), stream=True
                )
            except httpx.TransportError as exc:  # refused, reset, or no first byte in time
                cause = _cause(exc)
                self._release(replica, uncached)
                if isinstance(exc, httpx.ConnectError):
                    self.replicas.mark_down(replica, cause)
                excluded.add(replica.node_id)
                failures.append(f"{replica.node_id}: {cause}")
                self.metrics.retries.labels(replica.node_id, cause.split(" ")[0]).inc()
                continue
            if upstream.status_code >= 500:
                await upstream.aclose()
                self._release(replica, uncached)
                excluded.add(replica.node_id)
                failures.append(f"{replica.node_id}: HTTP {upstream.status_code}")
                self.metrics.retries.labels(replica.node_id, "http_5xx").inc()
                continue
            held = [m.num_blocks for node_id, m in lookup.matches.items() if node_id != replica.node_id]
            chosen = lookup.matches.get(replica.node_id)
            routed = _Routed(replica, decision, upstream, started, prefilling_tokens=uncached)
            routed.held = (chosen.num_blocks if chosen is not None else 0, max(held, default=0))
            if not (streamed and upstream.status_code == 200):
                self._prefilled(routed)
            return routed
        tried = "; ".join(failures) if failures else "none is healthy"
        raise _NoReplica(f"No engine replica could serve the request ({tried}); retry shortly.")

    async def _disaggregated(
        self,
        path: str,
        payload: dict[str, Any],
        headers: dict[str, str],
        token_ids: list[int],
        hashes,
        session_id: str,
        tenant: str,
        unkeyed: str,
    ) -> _Routed:
        """The two-step flow of the vLLM connector's kv_producer / kv_consumer: the prompt
        is computed on the prefill replica its prefix costs least on (the session sticks
        there: that is where its chain lives), which hands its KV, layer by layer, to the
        least-loaded decode replica's daemon; the decode replica then answers the client.
        A decode replica that fails before answering is replaced by another, which
        recomputes the prompt (the connector's fallback, as for a handoff that never comes)."""
        model = payload["model"]
        decoders = self.replicas.candidates(set(), ("decode",), model)
        decoders.sort(key=lambda c: (c.active_requests + c.queued_tokens, c.node_id))
        if not decoders:
            raise _NoReplica("No decode replica is healthy; retry once one is back.")
        decoder = self.replicas.replicas[decoders[0].node_id]
        addresses = {node.node_id: node.transport_address for node in await self.index.nodes()}
        destination = addresses.get(decoder.node_id, "")
        if not destination:
            raise _NoReplica(f"The decode replica {decoder.node_id}'s daemon is not in the index; retry shortly.")
        transfer_id = f"kvstore-router-{uuid.uuid4().hex}"
        prefill_body = json.dumps(prefill_request(payload, transfer_id, destination)).encode()
        prefill = await self._send(
            path, prefill_body, headers, token_ids, hashes, session_id, roles=("prefill",), model=model, unkeyed=unkeyed
        )
        try:
            content = await prefill.upstream.aread()
        finally:
            await prefill.upstream.aclose()
            self._finish(prefill)
        self._observe(prefill, tenant, stream=False, usage=_usage_of(content))
        if prefill.upstream.status_code != 200:
            raise _Upstream(prefill.upstream, prefill.replica.node_id)
        params = decode_transfer_params(content)
        decode_body = json.dumps({**payload, "kv_transfer_params": params} if params else payload).encode()
        others = {r.node_id for r in self.replicas.replicas.values() if r.node_id != decoder.node_id}
        try:
            routed = await self._send(path, decode_body, headers, token_ids, [], "", roles=("decode",), excluded=others, model=model)
        except _NoReplica:  # the handoff's destination failed: another decode replica computes the prompt
            original = json.dumps(payload).encode()
            routed = await self._send(
                path, original, headers, token_ids, hashes, "", roles=("decode",), excluded={decoder.node_id}, model=model, unkeyed=unkeyed
            )
        return dataclasses.replace(routed, prefill_node_id=prefill.replica.node_id)

    def _with_cache(self, candidate: Candidate, members: dict[str, Replica], now: float) -> Candidate:
        """``candidate`` with its replica's cache size (``cache_bytes`` in whole blocks of the
        engines' namespace) and the distinct tokens of the live sessions this router placed
        there: what the cost model's pressure term weighs (index/scoring.py)."""
        cache_bytes = members[candidate.node_id].config.cache_bytes
        if not cache_bytes:
            return candidate
        ns = self.config.namespace
        cache_tokens = cache_bytes // ns.block_bytes * ns.block_size
        return dataclasses.replace(candidate, cache_tokens=cache_tokens, live_tokens=self.live.tokens_on(candidate.node_id, now))

    def _release(self, replica: Replica, uncached: int) -> None:
        replica.in_flight -= 1
        replica.prefilled(uncached)
        self.replicas.publish_load(replica)

    def _prefilled(self, routed: _Routed) -> None:
        if routed.prefilled():
            self.replicas.publish_load(routed.replica)

    def _finish(self, routed: _Routed) -> None:
        routed.prefilled()  # a stream that ended before its first chunk
        routed.replica.in_flight -= 1
        self.replicas.publish_load(routed.replica)

    async def _relay(self, routed: _Routed, tenant: str) -> AsyncIterator[bytes]:
        """The engine's stream, chunk by chunk as it arrives; the tail is kept for its usage."""
        tail = b""
        first = True
        try:
            async for chunk in routed.upstream.aiter_raw():
                if first:
                    self.metrics.ttft.labels(routed.replica.node_id, "true").observe(time.monotonic() - routed.started)
                    self._prefilled(routed)
                    first = False
                tail = (tail + chunk)[-_USAGE_TAIL_BYTES:]
                if routed.accounting is not None and routed.accounting.answer is not None:
                    routed.accounting.answer.feed(chunk)
                yield chunk
        finally:
            await routed.upstream.aclose()
            self._finish(routed)
        accounting = routed.accounting
        answer = accounting.answer.digest() if accounting is not None and accounting.answer is not None else None
        self._observe(routed, tenant, stream=True, usage=_stream_usage(tail), answer=answer)

    def _observe(self, routed: _Routed, tenant: str, stream: bool, usage: dict | None, answer: int | None = None) -> None:
        node_id = routed.replica.node_id
        self.metrics.requests.labels(node_id, str(routed.upstream.status_code)).inc()
        if not stream:
            self.metrics.ttft.labels(node_id, "false").observe(time.monotonic() - routed.started)
        if usage is None:
            return
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") or 0
        if isinstance(prompt, int) and isinstance(cached, int):
            self.metrics.usage(node_id, tenant, prompt, cached)
            if routed.upstream.status_code == 200:
                self._attribute(routed, tenant, prompt, cached, usage.get("completion_tokens"), answer)
        tokenizer = self.tokenizer
        if isinstance(prompt, int) and routed.tokenized_here is not None and tokenizer is not None and routed.upstream.status_code == 200:
            if not tokenizer.compare_count(routed.tokenized_here, prompt):
                self.metrics.tokenizer_mismatches.inc()

    def _account(
        self,
        routed: _Routed,
        tenant: str,
        session_id: str,
        kind: str,
        token_ids: list[int],
        hashes: list,
        payload: dict[str, Any],
        stream: bool,
    ) -> _Accounting:
        """What the router knew of a keyed request's prompt as it routed it (misses.RouteView),
        and, for a session, its turn in the session log (whose divergence is counted now)."""
        turn, kept, sent = None, 0, 0
        if session_id:
            turn, kept, sent = self.session_log.begin(session_id, tenant, routed.replica.node_id, token_ids, payload)
            if turn.divergence is not None:
                self.metrics.diverged(turn.divergence.part, turn.divergence.lost_tokens)
        chosen, elsewhere = routed.held
        view = RouteView(len(hashes), chosen, elsewhere, self.seen.prefix(hashes), kept, sent)
        answer = _AnswerText() if session_id and kind == "chat" and stream else None
        return _Accounting(view, tenant, hashes, token_ids, session_id, turn, answer)

    def _attribute(self, routed: _Routed, tenant: str, prompt: int, cached: int, completion: Any, answer: int | None) -> None:
        """A request's computed tokens by cause (misses.py), counted; its chain is the
        fleet's now, and its turn is the session's latest."""
        node_id = routed.replica.node_id
        accounting = routed.accounting
        if accounting is None:  # not keyed, the router cannot say; or a disaggregated request's half, not attributed
            if routed.unkeyed:
                self.metrics.misses(node_id, tenant, {"unkeyed": max(prompt - cached, 0)})
            return
        causes = attribute(accounting.view, prompt, cached, self.config.namespace.block_size)
        self.metrics.misses(node_id, tenant, causes)
        self.seen.record(accounting.hashes)
        turn = accounting.turn
        if turn is not None:
            turn.prompt_tokens, turn.cached_tokens, turn.causes = prompt, cached, causes
            done = Answer(completion if isinstance(completion, int) else 0, answer)
            self.session_log.finish(accounting.session_id, turn, accounting.token_ids, done)
        if routed.retained:  # its chain kept on its replica through the session's pause
            self.retention.turn_ended(accounting.session_id, node_id, self.config.namespace.digest, accounting.hashes, time.monotonic())

    def _tenant(self, request: Request) -> str | None:
        """The request's tenant. With API keys, the one its key names — a tenant header is
        not read: the client does not choose — and None when it presents no key the router
        knows. Without, the tenant header, else a digest of its credential."""
        keys = self.config.api_keys
        if keys:
            presented = presented_key(request.headers)
            return keys.tenant_of(presented) if presented else None
        named = request.headers.get(self.config.tenant_header)
        if named:
            return named[:64]
        key = request.headers.get("authorization", "")
        if key:
            return f"key-{xxhash.xxh64_hexdigest(key.encode())[:8]}"
        return "anonymous"

    def _engine_headers(self, request: Request, names: tuple[str, ...]) -> dict[str, str]:
        """The client's headers among ``names`` that an engine gets. With API keys the
        client's credential is the router's, never passed on."""
        passed = tuple(n for n in names if n != "authorization") if self.config.api_keys else names
        return {k: v for k, v in request.headers.items() if k in passed}


def _unauthorized() -> JSONResponse:
    return openai_error(401, _UNAUTHORIZED, code="invalid_api_key", headers={"www-authenticate": "Bearer"})


class _Upstream(Exception):
    """An engine's 4xx answer to a request of the router's making (its /tokenize, or a
    prefill), answered as an OpenAI error naming the client's field."""

    def __init__(self, response: httpx.Response, node_id: str) -> None:
        super().__init__(response.status_code)
        self.response, self.node_id = response, node_id

    def translated(self, kind: str, payload: dict[str, Any]) -> JSONResponse:
        return engine_error(self.response.status_code, self.response.content, kind, payload, {"x-kvstore-replica": self.node_id})


def _cause(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connect refused or unreachable"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout before the first byte"
    return f"transport {type(exc).__name__}"


def _reason_kind(reason: str) -> str:
    """A decision's reason as a bounded label: retry, unkeyed (routed by load and session
    alone), sticky, moved_unavailable, moved_cost or best_cost."""
    if reason.startswith("retry"):
        return "retry"
    if reason.startswith("unkeyed"):
        return "unkeyed"
    if reason.startswith("sticky"):
        return "sticky"
    if reason.startswith("moved") and "not a candidate" in reason:
        return "moved_unavailable"
    if reason.startswith("moved"):
        return "moved_cost"
    return "best_cost"


def _usage_and_answer(content: bytes, with_answer: bool) -> tuple[dict | None, int | None]:
    """An answer's usage and, ``with_answer``, the digest of its chat message
    (session_log.answer_digest; None for any other answer), from one parse of its body."""
    try:
        document = json.loads(content)
    except ValueError:
        return None, None
    if not isinstance(document, dict):
        return None, None
    usage = document.get("usage")
    usage = usage if isinstance(usage, dict) else None
    if not with_answer:
        return usage, None
    try:
        message = document["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return usage, None
    return usage, answer_digest(message.get("content"), message.get("tool_calls")) if isinstance(message, dict) else None


def _usage_of(content: bytes) -> dict | None:
    return _usage_and_answer(content, with_answer=False)[0]


def _stream_usage(tail: bytes) -> dict | None:
    """The usage of the last SSE event that has one (``stream_options.include_usage``)."""
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data:") and b'"usage"' in line:
            usage = _usage_of(line[5:].strip())
            if usage is not None:
                return usage
    return None


def build_app(config: RouterConfig, load: Callable[[], RouterConfig] | None = None) -> Starlette:
    gateway = Gateway(config, load)
    routes = [
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
        Route("/kvstore/sessions", gateway.session_list, methods=["GET"]),
        Route("/kvstore/sessions/{session_id:path}", gateway.session_show, methods=["GET"]),
        drain_plan_route(gateway),  # GET /kvstore/drain-plan (scaledown.py)
    ]
    app = Starlette(routes=routes, lifespan=gateway.lifespan)
    app.state.gateway = gateway
    return app
