"""UCX transport through ucxx: RDMA between hosts, TCP or shared memory on one, whatever
UCX finds; the payload is received by UCX straight into the caller's buffer.

A frame is one or two tagged UCX messages on the endpoint's tag, matched in order:

    header message   the 72-byte header, followed by the payload itself when it is at most
                     INLINE_BYTES (control frames, small blocks: one eager message)
    payload message  the payload, when larger: UCX rendezvous moves it from the sender's
                     buffer into the buffer ``recv_payload`` posts, the destination slot

The receiver learns a payload's length from its header before it posts the payload's
receive, so the interface needs no sizes up front. ``send_many`` posts the messages of up
to ``transport.window_blocks`` frames before it waits for the oldest (UCX keeps their
order); a receive is posted as soon as the caller asks for it.

ucxx is imported lazily, so a daemon without the ``[ucx]`` extra imports kvstore fine.
Before that first import the config's UCX defaults go into the environment (never over a
value the environment already sets), because UCX reads them when its context starts:
rendezvous by ``put_zcopy`` and ``blocking`` progress measured ~3 GB/s on loopback against
~0.7 with UCX's defaults.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
from typing import Any, Callable, Iterable, Iterator

from kvstore.errors import CorruptBlock, InvalidArgument, TierUnavailable, TransferFailed
from kvstore.transport.base import Buffer, Channel, ChannelHandler, Transport, split_address
from kvstore.transport.config import TransportConfig
from kvstore.transport.serving import ChannelRegistry, FramedChannel, address_of
from kvstore.transport.wire import HEADER_BYTES, FrameHeader

__all__ = ["UcxTransport", "import_ucxx", "ucx_environment"]

# header + payload up to UCX's eager limit (ucxx sets UCX_RNDV_THRESH=8192) travel as one
# message; larger payloads get a message of their own, received in place
INLINE_BYTES = 8192 - HEADER_BYTES


def ucx_environment(config: TransportConfig) -> dict[str, str]:
    """The variables this transport sets when the environment does not."""
    return {
        "UCX_RNDV_SCHEME": config.ucx_rndv_scheme,
        "UCXPY_PROGRESS_MODE": config.ucx_progress_mode,  # ucxx reads UCXPY_*, not UCXX_*
        "UCX_WARN_UNUSED_ENV_VARS": "n",  # UCXPY_* and unused UCX_* would be warned about
    }


def import_ucxx(config: TransportConfig) -> Any:
    """ucxx, imported after the config's UCX defaults are in the environment."""
    for name, value in ucx_environment(config).items():
        os.environ.setdefault(name, value)
    try:
        import ucxx
    except (ImportError, OSError) as exc:  # not installed, or libucx would not load
        raise TierUnavailable(f"the UCX transport needs ucxx ({exc}); install it with pip install 'kvstore[ucx]', or set transport.kind = \"tcp\".") from exc
    return ucxx


class _UcxChannel(FramedChannel):
    def __init__(self, ucxx: Any, endpoint: Any, peer: str, window_frames: int, forget: Callable[[Channel], None]) -> None:
        super().__init__(peer, forget)
        self._ucxx, self._endpoint, self._window_frames = ucxx, endpoint, window_frames
        self._header = bytearray(HEADER_BYTES + INLINE_BYTES)

    # -- sending ---------------------------------------------------------------------
    async def send(self, header: FrameHeader, payload: Buffer = b"") -> None:
        await self.send_many([(header, payload)])

    async def send_many(self, frames: Iterable[tuple[FrameHeader, Buffer]]) -> None:
        self._check_usable()
        loop = asyncio.get_running_loop()
        in_flight: collections.deque[asyncio.Task] = collections.deque()
        try:
            with self._translated("sending"):
                for header, payload in frames:
                    # tasks start in creation order and post their UCX send before their
                    # first await, so the messages go out in this order
                    for message in self._messages(header, payload):
                        in_flight.append(loop.create_task(self._endpoint.send(message)))
                    while len(in_flight) > 2 * self._window_frames:
                        await in_flight.popleft()
                while in_flight:
                    await in_flight.popleft()
        except InvalidArgument:  # a malformed frame, refused before any of it was posted
            await asyncio.gather(*in_flight, return_exceptions=True)
            raise
        except BaseException:
            self._abandon("a send stopped in the middle of a window")
            await asyncio.gather(*in_flight, return_exceptions=True)
            raise

    def _messages(self, header: FrameHeader, payload: Buffer) -> tuple[Buffer, ...]:
        view = self._outgoing_payload(header, payload)
        if view.nbytes <= INLINE_BYTES:
            return (header.pack() + view,)
        return header.pack(), view

    # -- receiving -------------------------------------------------------------------
    async def recv_header(self) -> FrameHeader:
        self._expect_header()
        self._header[:HEADER_BYTES] = bytes(HEADER_BYTES)  # a short message must not leave an old header behind
        try:
            with self._translated("receiving a frame header"):
                await self._endpoint.recv(self._header)
        except asyncio.CancelledError:
            self._abandon("a header receive was cancelled")
            raise
        return self._accept_header(memoryview(self._header)[:HEADER_BYTES])

    async def recv_payload(self, into: memoryview) -> None:
        view = self._incoming_payload(into)
        if view.nbytes <= INLINE_BYTES:
            view[:] = memoryview(self._header)[HEADER_BYTES : HEADER_BYTES + view.nbytes]
        else:
            self._check_usable()
            try:
                with self._translated(f"receiving a {view.nbytes}-byte payload"):
                    await self._endpoint.recv(view)
            except BaseException:
                self._abandon("a payload receive did not finish")
                raise
        self._pending_length = None

    # -- plumbing --------------------------------------------------------------------
    def _abandon(self, reason: str) -> None:
        """Out of step, and the endpoint aborted at once: a receive UCX still holds would
        otherwise land in a slot its caller has since given to another block, and a send
        would go on reading a buffer its caller has let go."""
        self._break(reason)
        self._endpoint.abort()

    @contextlib.contextmanager
    def _translated(self, doing: str) -> Iterator[None]:
        """ucxx's exceptions as kvstore's, each a sentence that names the peer."""
        exceptions = self._ucxx.exceptions
        try:
            yield
        except exceptions.UCXMessageTruncatedError as exc:
            self._break("a message was longer than its frame announced")
            raise CorruptBlock(f"a message from {self.peer} was longer than its frame announced; the channel is out of step.") from exc
        except exceptions.UCXError as exc:
            self._break("the endpoint failed")
            if self._closed:
                raise TransferFailed(f"the channel to {self.peer} was closed while {doing}.") from exc
            raise TransferFailed(f"the UCX channel to {self.peer} failed while {doing}: {exc}.") from exc

    async def close(self) -> None:
        """Close the endpoint; UCX cancels its posted receives, which wakes their tasks."""
        if not self._mark_closed():
            return
        with contextlib.suppress(self._ucxx.exceptions.UCXError):
            await self._endpoint.close()


class UcxTransport(Transport):
    """Channels over ucxx endpoints; one UCX listener per transport.

    UCX listens on every interface; ``host`` only names the address peers are told.
    """

    scheme = "ucx"

    def __init__(self, config: TransportConfig) -> None:
        self._config = config
        self._ucxx = import_ucxx(config)
        self._registry = ChannelRegistry()
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
        return self._registry.adopt(_UcxChannel(self._ucxx, endpoint, address, self._config.window_blocks, self._registry.forget))

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await self._registry.close()
