"""UCX transport through ucxx: RDMA between hosts, TCP or shared memory on one, whatever
UCX finds; the payload is received by UCX straight into the caller's buffer.

Frames travel in batches, each as tagged UCX messages on the endpoint's tag, matched in
order:

    batch message     a 12-byte prefix (b"KVSB", entry count, byte count), then for each
                      frame its 96-byte header, followed by the payload itself when it is
                      at most INLINE_BYTES (control frames, small blocks)
    payload messages  one per larger payload, in the batch's order: UCX rendezvous moves
                      each from the sender's buffer into the buffer the receiver posted,
                      the destination slot

A receiver learns a whole batch of headers from one message, so it can post the receives
of all of the batch's payloads (``start_payload``) before any has landed: the sender's
rendezvous then proceed inside UCX without a turn of the receiver's event loop per block.
``send_many`` fills a batch with up to ``transport.window_blocks`` frames (or 4 MiB of
payload; the first batch is one frame, so the receiver starts at once) and keeps two
batches in flight while it computes the checksums of the next (UCX keeps their order).
Sends and receives are posted straight on ucxx's endpoint, in call order (``UcxPoster``),
and complete through kvstore's event-driven progress on the loop (transport/
ucx_progress.py) or, in ucxx's own progress modes, through ucxx.

ucxx is imported lazily, so a daemon without the ``[ucx]`` extra imports kvstore fine.
Before that first import the config's UCX defaults go into the environment (never over a
value the environment already sets), because UCX reads them when its context starts:
rendezvous by ``put_zcopy``, and kvstore's ``event`` progress (ucxx in its blocking mode,
progressed on the event loop by transport/ucx_progress.py, idle in epoll between
transfers); ucxx's ``thread`` and ``blocking`` modes remain selectable. ucxx binds its
context to one event loop: the last transport of a process to close resets it (stopping
the notifier thread of ucxx's thread mode, without which a process would not exit).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import struct
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

from kvstore.errors import CorruptBlock, InvalidArgument, TransferFailed, TransportUnavailable
from kvstore.transport import ucx_progress
from kvstore.transport.auth import PeerAuth
from kvstore.transport.base import LANDED, Buffer, Channel, ChannelHandler, Transport, split_address
from kvstore.transport.config import TransportConfig
from kvstore.transport.serving import ChannelRegistry, FramedChannel, address_of
from kvstore.transport.wire import HEADER_BYTES, FrameHeader

__all__ = ["UcxTransport", "UcxPoster", "import_ucxx", "pack_batch", "ucx_environment"]

logger = logging.getLogger(__name__)

# payloads up to INLINE_BYTES ride in their batch message; a batch holds at most
# BATCH_BYTES, which is what a receiver posts for the next one (a batch of block headers
# stays below UCX's eager limit, 8 KiB under ucxx, and so costs no rendezvous)
INLINE_BYTES = 4096
BATCH_BYTES = 64 * 1024
# a batch closes at window_blocks frames or once its payloads reach BATCH_PAYLOAD_BYTES, so
# that large blocks still move in several batches: the sender checksums the next batch
# while BATCHES_IN_FLIGHT - 1 move (measured on loopback: 4 MiB and 3 beat 1-8 MiB and 2-4)
BATCH_PAYLOAD_BYTES = 4 << 20
BATCHES_IN_FLIGHT = 3
_PREFIX = struct.Struct("<4sII")
_BATCH_MAGIC = b"KVSB"
QUIESCE_S = 5.0  # how long an aborted channel waits for UCX to end its requests


def ucx_environment(config: TransportConfig) -> dict[str, str]:
    """The variables this transport sets when the environment does not. A progress mode
    the environment names wins over the config's: ``KVSTORE_TRANSPORT_UCX_PROGRESS_MODE``
    (the daemon's own config variable, which this sets for kvstore's ``event`` mode, so
    that daemons and senders started from this process run in it too), then ucxx's
    ``UCXPY_PROGRESS_MODE``."""
    mode = os.environ.get("KVSTORE_TRANSPORT_UCX_PROGRESS_MODE") or os.environ.get("UCXPY_PROGRESS_MODE") or config.ucx_progress_mode
    environment = {"UCX_RNDV_SCHEME": config.ucx_rndv_scheme, "UCX_WARN_UNUSED_ENV_VARS": "n"}  # UCXPY_* would be warned about
    if mode == "event":  # ucxx in its blocking mode, progressed by transport/ucx_progress.py
        environment |= {"KVSTORE_TRANSPORT_UCX_PROGRESS_MODE": "event", "UCXPY_PROGRESS_MODE": "blocking"}
    else:
        environment["UCXPY_PROGRESS_MODE"] = mode  # ucxx reads UCXPY_*, not UCXX_*
        if mode.startswith("thread"):
            environment["UCXPY_ENABLE_PYTHON_FUTURE"] = "1"  # completions wake the loop, no polling
    return environment


def import_ucxx(config: TransportConfig) -> Any:
    """ucxx, imported after the config's UCX defaults are in the environment."""
    for name, value in ucx_environment(config).items():
        os.environ.setdefault(name, value)
    try:
        import ucxx
    except (ImportError, OSError) as exc:  # not installed, or libucx would not load
        raise TransportUnavailable(
            f"the UCX transport needs ucxx ({exc}); install it with pip install 'kvstore[ucx]', or set transport.kind = \"tcp\"."
        ) from exc
    if os.environ.get("KVSTORE_TRANSPORT_UCX_PROGRESS_MODE") == "event":
        ucx_progress.install(ucxx)
    _stop_at_exit(ucxx)
    return ucxx


_exit_hook: list[bool] = []


def _stop_at_exit(ucxx: Any) -> None:
    """Stop ucxx's notifier thread before the interpreter joins its threads at exit (a
    process that never closed its transport would hang there otherwise)."""
    if _exit_hook:
        return
    _exit_hook.append(True)
    register = getattr(threading, "_register_atexit", None)  # runs before threads are joined
    if register is not None:
        register(ucxx.stop_notifier_thread)


class _UcxChannel(FramedChannel):
    def __init__(self, ucxx: Any, endpoint: Any, peer: str, window_frames: int, forget: Callable[[Channel], None]) -> None:
        super().__init__(peer, forget)
        self._ucxx, self._endpoint, self._window_frames = ucxx, endpoint, window_frames
        self._poster = UcxPoster(endpoint)
        self._loop = asyncio.get_running_loop()
        self._batch = bytearray(BATCH_BYTES)
        self._entries: collections.deque[tuple[FrameHeader, memoryview | None]] = collections.deque()
        self._inline: memoryview | None = None  # the payload of the header just read, if it rode along
        self._carried: tuple[FrameHeader, Buffer] | None = None  # the frame that opens the next batch
        self._aborted = False

    # -- sending ---------------------------------------------------------------------
    async def send(self, header: FrameHeader, payload: Buffer = b"") -> None:
        await self.send_many([(header, payload)])

    async def send_many(self, frames: Iterable[tuple[FrameHeader, Buffer]]) -> None:
        self._check_usable()
        frames = iter(frames)
        in_flight: collections.deque[list[asyncio.Future]] = collections.deque()
        try:
            # the first batch is one frame, so that the receiver starts on it while the
            # sender checksums the rest
            limit = 1
            while batch := self._next_batch(frames, limit):
                limit = self._window_frames
                in_flight.append([self._post(message, "sending") for message in batch])
                while len(in_flight) >= BATCHES_IN_FLIGHT:
                    for sent in in_flight.popleft():
                        await sent
            while in_flight:
                for sent in in_flight.popleft():
                    await sent
        except InvalidArgument:  # a malformed frame, refused before any of its batch was posted
            await self._quiesce()
            raise
        except BaseException:
            self._abandon("a send stopped in the middle of a batch")
            await self._quiesce()
            raise

    def _next_batch(self, frames: Iterator[tuple[FrameHeader, Buffer]], max_frames: int) -> list[Buffer]:
        """The messages of the next batch of up to ``max_frames`` frames: its headers (with
        inline payloads), then the larger payloads; empty when ``frames`` is done."""
        parts: list[Buffer] = []
        payloads: list[memoryview] = []
        count, nbytes, payload_bytes = 0, _PREFIX.size, 0
        while count < max_frames and payload_bytes < BATCH_PAYLOAD_BYTES:
            item, self._carried = self._carried or next(frames, None), None
            if item is None:
                break
            header, payload = item
            view = self._outgoing_payload(header, payload)
            inline = view.nbytes <= INLINE_BYTES
            size = HEADER_BYTES + (view.nbytes if inline else 0)
            if count and nbytes + size > BATCH_BYTES:
                self._carried = item  # opens the next batch
                break
            parts.append(self._signed(header, view).pack())
            (parts if inline else payloads).append(view)
            count, nbytes, payload_bytes = count + 1, nbytes + size, payload_bytes + view.nbytes
        if not count:
            return []
        return [pack_batch(parts, count), *payloads]

    # -- receiving -------------------------------------------------------------------
    async def recv_header(self) -> FrameHeader:
        self._expect_header()
        if not self._entries:
            await self._recv_batch()
        header, self._inline = self._entries.popleft()
        self._pending_length = header.length
        return header

    async def _recv_batch(self) -> None:
        self._batch[: _PREFIX.size] = bytes(_PREFIX.size)  # a short message must not leave an old prefix behind
        receiving = self._post(self._batch, "receiving a batch of frame headers", receive=True)
        try:
            await receiving
        except asyncio.CancelledError:
            self._abandon("a header receive was cancelled")
            await self._quiesce()
            raise
        view = memoryview(self._batch)
        magic, count, nbytes = _PREFIX.unpack_from(view)
        if magic != _BATCH_MAGIC or not 0 < count or not _PREFIX.size < nbytes <= BATCH_BYTES:
            self._break("a batch message was malformed")
            raise CorruptBlock(f"a message from {self.peer} is not a kvstore frame batch; the channel is out of step.")
        offset = _PREFIX.size
        for _ in range(count):
            if offset + HEADER_BYTES > nbytes:
                break
            header = self._accept_header(view[offset : offset + HEADER_BYTES])
            offset += HEADER_BYTES
            inline = None
            if header.length <= INLINE_BYTES:
                inline = view[offset : offset + header.length]
                offset += header.length
            self._entries.append((header, inline))
        self._pending_length = None
        if offset != nbytes or len(self._entries) != count:
            self._entries.clear()
            self._break("a batch message was malformed")
            raise CorruptBlock(
                f"a frame batch from {self.peer} does not add up ({count} frames in {nbytes} bytes); the channel is out of step."
            )

    async def recv_payload(self, into: memoryview) -> None:
        landing = await self.start_payload(into)
        try:
            await landing
        except asyncio.CancelledError:
            self._abandon("a payload receive was cancelled")
            await self._quiesce()
            raise

    async def start_payload(self, into: memoryview) -> Awaitable[None]:
        view = self._incoming_payload(into)
        self._pending_length = None
        if self._inline is not None:
            view[:] = self._inline  # the next batch lands in the same buffer only after this
            self._inline = None
            return LANDED
        self._check_usable()
        return self._post(view, f"receiving a {view.nbytes}-byte payload", receive=True)

    # -- requests in flight ----------------------------------------------------------
    def _post(self, buffer: Buffer, doing: str, receive: bool = False) -> asyncio.Future:
        """Post one tagged message (posted in call order, which is the order UCX matches
        them in); the returned future resolves when UCX is done with it, or fails with
        kvstore's error (and the channel is abandoned: its stream is out of step).

        Each request stays tracked until UCX completes it, whatever happens to the future
        returned: cancelling a wait cannot cancel the request, which would stay free to
        read or fill a buffer its caller has let go. A caller that gives up aborts the
        endpoint instead, which ends them all, and waits for them (``_quiesce``)."""
        self._check_usable()
        outcome = self._loop.create_future()
        try:
            completion = self._poster.post(buffer, receive)
        except self._ucxx.exceptions.UCXError as exc:
            outcome.set_exception(self._translate(exc, doing))
            return outcome

        def complete(done: asyncio.Future) -> None:
            error = None if done.cancelled() else done.exception()
            if error is not None:
                if not isinstance(error, CorruptBlock | TransferFailed):
                    error = self._translate(error, doing)
                self._abandon(f"a UCX request failed while {doing}")
            if outcome.done():
                return
            if error is None:
                outcome.set_result(None)
            else:
                outcome.set_exception(error)
                outcome.exception()  # raised to whoever awaits it; the channel is broken for the rest

        completion.add_done_callback(complete)
        return outcome

    async def _quiesce(self) -> None:
        in_flight = self._poster.in_flight()
        if not in_flight:
            return
        _, stuck = await asyncio.wait(in_flight, timeout=QUIESCE_S)
        if stuck:
            logger.error(
                "%d UCX requests to %s did not end %gs after the endpoint was aborted; their buffers stay held until they do",
                len(stuck),
                self.peer,
                QUIESCE_S,
            )

    @property
    def touching_buffers(self) -> bool:
        return bool(self._poster.in_flight())

    async def settled(self) -> None:
        while in_flight := self._poster.in_flight():
            await asyncio.wait(in_flight)

    # -- plumbing --------------------------------------------------------------------
    def _abandon(self, reason: str) -> None:
        """Out of step, and the endpoint aborted at once: a receive UCX still holds would
        otherwise land in a slot its caller has since given to another block, and a send
        would go on reading a buffer its caller has let go."""
        self._break(reason)
        if not self._aborted:
            self._aborted = True
            self._endpoint.abort()

    def _translate(self, exc: BaseException, doing: str) -> Exception:
        """A ucxx exception as kvstore's, a sentence that names the peer."""
        exceptions = self._ucxx.exceptions
        if isinstance(exc, exceptions.UCXMessageTruncatedError):
            self._break("a message was longer than its frame announced")
            return CorruptBlock(f"a message from {self.peer} was longer than its frame announced; the channel is out of step.")
        self._break("the endpoint failed")
        if self._closed:
            return TransferFailed(f"the channel to {self.peer} was closed while {doing}.")
        return TransferFailed(f"the UCX channel to {self.peer} failed while {doing}: {exc}.")

    async def close(self) -> None:
        """Close the endpoint. With requests still posted it is aborted, and close returns
        only once UCX has ended them: nothing lands in a slot after that."""
        if not self._mark_closed():
            return
        if self._poster.in_flight():
            self._abandon("the channel was closed with requests in flight")
        if self._aborted:
            await self._quiesce()
            return
        with contextlib.suppress(self._ucxx.exceptions.UCXError):
            await self._endpoint.close()


def pack_batch(parts: list[Buffer], count: int) -> bytes:
    """A batch message: the prefix, then ``count`` headers each with its inline payload."""
    body = b"".join(parts)
    return _PREFIX.pack(_BATCH_MAGIC, count, _PREFIX.size + len(body)) + body


class UcxPoster:
    """Posts tagged sends and receives straight on a ucxx endpoint, in call order (the
    order UCX matches them in), where ``Endpoint.send``/``recv`` would add a coroutine, a
    task and, outside ucxx's thread mode, a wait that polls the event loop per message.

    ``post`` returns a future that resolves when UCX is done with the request (with
    ucxx's exception when it failed); the request and its buffer are kept alive until
    then. It completes through the loop's `EventProgress` (kvstore's ``event`` mode), the
    future ucxx's notifier resolves (``thread`` modes), or else the request's own wait in
    a task. bench.transport posts its raw ucxx messages through this too."""

    def __init__(self, endpoint: Any) -> None:
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        self._array, self._mask = Array, TagMaskFull
        self._ep = endpoint._ep
        self._progress = ucx_progress.progress_for(asyncio.get_running_loop())
        self._futures = endpoint._ctx.enable_python_future  # request.future blocks without them
        self._send_tag, self._recv_tag = (
            t if isinstance(t, Tag) else Tag(t) for t in (endpoint._tags["msg_send"], endpoint._tags["msg_recv"])
        )
        self._kept: dict[asyncio.Future, tuple[Any, ...]] = {}

    def post(self, buffer: Buffer, receive: bool = False) -> asyncio.Future:
        array = self._array(buffer)
        if receive:
            request = self._ep.tag_recv(array, self._recv_tag, self._mask)
        else:
            request = self._ep.tag_send(array, self._send_tag)
        if self._progress is not None:
            completion = self._progress.watch(request)
        elif self._futures:
            completion = request.future
        else:
            completion = asyncio.ensure_future(request.wait())
        self._kept[completion] = (request, array, buffer)
        completion.add_done_callback(self._release)
        return completion

    def _release(self, completion: asyncio.Future) -> None:
        self._kept.pop(completion, None)

    def in_flight(self) -> list[asyncio.Future]:
        """The completions of the requests UCX is not done with yet."""
        return list(self._kept)


class UcxTransport(Transport):
    """Channels over ucxx endpoints; one UCX listener per transport.

    UCX listens on every interface; ``host`` only names the address peers are told.
    """

    scheme = "ucx"
    _open = 0  # UCX transports of this process not yet closed

    def __init__(self, config: TransportConfig, auth: PeerAuth | None = None) -> None:
        self._config = config
        self.auth = PeerAuth.from_config(config) if auth is None else auth
        self._ucxx = import_ucxx(config)
        self._closed = False
        UcxTransport._open += 1
        self._registry = ChannelRegistry(config, self.auth)
        self._listener: Any = None
        self._accepted = itertools.count(1)

    async def listen(self, host: str, port: int, on_channel: ChannelHandler) -> str:
        if self._listener is not None:
            raise InvalidArgument("this UCX transport is already listening.")
        address = ""

        async def accept(endpoint: Any) -> None:
            peer = f"peer #{next(self._accepted)} of {address}"
            channel = _UcxChannel(self._ucxx, endpoint, peer, self._config.window_blocks, self._registry.forget)
            self._registry.serve(channel, on_channel)

        try:
            self._listener = self._ucxx.create_listener(accept, port)
        except self._ucxx.exceptions.UCXError as exc:
            raise InvalidArgument(f"UCX cannot listen for peers on port {port}: {exc}; set transport.port.") from exc
        address = address_of(self.scheme, host, self._listener.port)
        return address

    async def connect(self, address: str, timeout_s: float = 5.0) -> Channel:
        host, port = split_address(address, self.scheme)
        try:
            endpoint = await asyncio.wait_for(self._ucxx.create_endpoint(host, port, connect_timeout=timeout_s), timeout_s)
        except asyncio.TimeoutError as exc:
            raise TransferFailed(f"connecting to {address} timed out after {timeout_s:g} s.") from exc
        except self._ucxx.exceptions.UCXError as exc:
            raise TransferFailed(f"cannot connect to {address}: {exc}.") from exc
        channel = _UcxChannel(self._ucxx, endpoint, address, self._config.window_blocks, self._registry.forget)
        return await self._registry.connected(channel, timeout_s)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await self._registry.close()
        if not self._closed:
            self._closed = True
            UcxTransport._open -= 1
            if not UcxTransport._open:
                _reset(self._ucxx)


def _reset(ucxx: Any) -> None:
    """Shut ucxx's context down (its notifier thread, its binding to this event loop); the
    next transport starts a fresh one. Objects still holding the old context keep it
    alive, which ucxx reports as an error: the new context is unaffected."""
    ucx_progress.close_all()
    try:
        ucxx.reset()
    except ucxx.exceptions.UCXError as exc:
        logger.debug("ucxx reset with objects still alive: %s", exc)
