"""Step messages on streams held open between daemons: a commit going down the commit
tree, a batch of prepares going up it, each answered as its own call would be.

Every step, the coordinator of 2,048 daemons takes a batch of prepares from each of its
children in the tree and sends each of them the commit. As unary calls, each one pays
for a call's setup, metadata, interception and teardown on both ends; as messages on a
stream opened once, it pays for its bytes and its answer
(scripts/grpc_calls_vs_stream.py measures both).

`StepStreams` (the sender) keeps one stream per channel, numbers each message and waits
for its answer; a refused message raises the `AioRpcError` its call would have raised,
so callers treat both alike. A stream that breaks fails every message waiting on it,
and the next message opens a new one. A peer that does not serve StepStream (an older
daemon) is sent unary calls instead. `answers` (the receiver) handles a stream's
messages side by side, as it would their calls, and answers each as it is done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from stalwart.core import wire
from stalwart.daemon.rpc.guard import escaped
from stalwart.v1 import common_pb2, peer_pb2

log = logging.getLogger("stalwart.daemon.rpc.step_stream")

_PEER = peer_pb2.DESCRIPTOR.services_by_name["PeerService"]


def _path(method: str) -> str:
    return f"/{_PEER.full_name}/{_PEER.methods_by_name[method].name}"


STEP_STREAM = _path("StepStream")
MAX_IN_FLIGHT = 64  # a stream's messages being handled at once; the next waits
_CODES = {code.value[0]: code for code in grpc.StatusCode}

# The kinds of message, each with the unary call it stands for (for older peers).
COMMIT, PREPARES = "commit", "prepares"
_UNARY = {COMMIT: (_path("CommitStep"), peer_pb2.CommitStepReply),
          PREPARES: (_path("RelayPrepares"), common_pb2.Ack)}
_SEQ_KEY = bytes([peer_pb2.StepMessage.DESCRIPTOR.fields_by_name["seq"].number << 3])
_BODY_KEY = {kind: wire.tag(peer_pb2.StepMessage.DESCRIPTOR, kind) for kind in _UNARY}


def frame(seq: int, kind: str, body: bytes) -> bytes:
    """The StepMessage of number `seq` holding `body` (a serialised CommitStepRequest or
    PrepareBatch, as `kind` says), around the body's own bytes."""
    return b"".join((_SEQ_KEY, wire.varint(seq), *wire.delimited(_BODY_KEY[kind], [body])))


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


# What grpc aio reports for a stream whose write raced its end (grpc/grpc#36066).
CORE_INTERNAL = "Internal error from Core"


class _MaskedStatus(Exception):
    """The first message of a stream failed with CORE_INTERNAL: the peer's own status
    is unknown (see StepStreams.send)."""


class _Stream:
    """One StepStream call: its messages waiting for their answers, by number."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.seq = 0
        self.waiting: dict[int, asyncio.Future[peer_pb2.StepAnswer]] = {}
        self.writing = asyncio.Lock()  # one write at a time on a call
        self.broken: grpc.aio.AioRpcError | None = None
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the peer ended the step stream")
        try:
            while (answer := await self.call.read()) is not grpc.aio.EOF:
                if answer is None:  # bytes that are not a StepAnswer (gRPC logs them)
                    error = rpc_error(grpc.StatusCode.INTERNAL,
                                      "the peer answered on the step stream with bytes that "
                                      "are not a StepAnswer")
                    self.call.cancel()
                    break
                waiter = self.waiting.pop(answer.seq, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(answer)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the step stream was closed here")
        except Exception as exc:  # whatever it is, no waiter is left hanging on it
            log.exception("the step stream's reader failed", exc_info=exc)
            error = rpc_error(grpc.StatusCode.INTERNAL, f"the step stream failed here "
                              f"({type(exc).__name__}: {exc})")
            self.call.cancel()
        self.broken = self.broken or error
        for waiter in self.waiting.values():
            if not waiter.done():
                waiter.set_exception(error)
        self.waiting.clear()

    def close(self) -> None:
        """End the call; the next message goes on a new stream."""
        self.broken = self.broken or rpc_error(grpc.StatusCode.CANCELLED,
                                               "the step stream was closed here")
        self.call.cancel()


class StepStreams:
    """The sending end: one stream per (channel, metadata) this daemon sends steps on."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, tuple], tuple[grpc.aio.Channel, _Stream]] = {}
        # peers without StepStream (an older daemon): their channels, by the same key
        self._unary: dict[tuple[int, tuple], grpc.aio.Channel] = {}

    async def send(self, channel: grpc.aio.Channel, kind: str, body: bytes, timeout: float,
                   metadata: tuple = ()) -> None:
        """Send `body` (a serialised message of `kind`) and wait at most `timeout` seconds
        for its answer; AioRpcError as its unary call would raise, or when the stream
        broke before the answer came."""
        key = (id(channel), metadata)
        if self._unary.get(key) is channel:
            await self._call(channel, kind, body, timeout, metadata)
            return
        try:
            answer = await self._on_stream(key, channel, kind, body, timeout, metadata)
        except _MaskedStatus as masked:
            # The first message of a stream, failed with the status a write racing the
            # call's end reports in grpc aio (grpc/grpc#36066: INTERNAL "Internal error
            # from Core" in place of the peer's own, UNIMPLEMENTED from a peer without the
            # stream): it goes as its unary call, which every daemon serves, and the next
            # message opens a new stream. Both kinds are idempotent (a commit of a step
            # committed with the same record, a prepare sent again, are taken as such).
            log.info("first message on a new step stream failed as its end raced the "
                     "write; sending it as a unary call", extra={"error": str(masked)})
            await self._call(channel, kind, body, timeout, metadata)
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.info("peer has no step stream; sending it unary calls",
                     extra={"error": exc.details()})
            self._unary[key] = channel
            await self._call(channel, kind, body, timeout, metadata)
            return
        if answer.code:
            raise rpc_error(_CODES.get(answer.code, grpc.StatusCode.UNKNOWN), answer.details)

    async def _on_stream(self, key: tuple[int, tuple], channel: grpc.aio.Channel, kind: str,
                         body: bytes, timeout: float, metadata: tuple) -> peer_pb2.StepAnswer:
        held = self._open.get(key)
        if held is None or held[0] is not channel or held[1].broken is not None:
            # Streams that ended are dropped with their channels (peers that left), here,
            # where a stream is opened: rare, and O(peers).
            for gone in [k for k, (_, s) in self._open.items() if s.broken is not None]:
                del self._open[gone]
            call = channel.stream_stream(STEP_STREAM, request_serializer=None,
                                         response_deserializer=peer_pb2.StepAnswer.FromString)
            held = self._open[key] = (channel, _Stream(call(metadata=metadata or None)))
        stream = held[1]
        stream.seq += 1
        seq = stream.seq
        waiter = stream.waiting[seq] = asyncio.get_running_loop().create_future()
        written = False
        try:
            async with asyncio.timeout(timeout):
                async with stream.writing:
                    try:
                        await stream.call.write(frame(seq, kind, body))
                    except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
                        # The call has ended or is ending: the reader fails the waiter
                        # with the call's own status (the write's can be a vaguer one).
                        pass
                    written = True
                try:
                    return await waiter
                except grpc.aio.AioRpcError as exc:
                    if seq == 1 and exc.code() == grpc.StatusCode.INTERNAL and \
                            exc.details() == CORE_INTERNAL:
                        raise _MaskedStatus(exc.details()) from exc
                    raise
        except TimeoutError:
            if not written:
                # The write itself is stuck (the peer takes no bytes): the call cannot
                # take another write, so it ends; the next message opens a new stream.
                stream.close()
            # Otherwise only this message fails, as its call would: the others on the
            # stream keep their own time (a peer stopped and resumed answers them).
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer on the step stream within {timeout:g} s") from None
        finally:
            stream.waiting.pop(seq, None)

    async def _call(self, channel: grpc.aio.Channel, kind: str, body: bytes, timeout: float,
                    metadata: tuple) -> None:
        method, reply = _UNARY[kind]
        call = channel.unary_unary(method, request_serializer=None,
                                   response_deserializer=reply.FromString)
        await call(body, timeout=timeout, metadata=metadata or None)

    def close(self) -> None:
        """End every stream (the next message opens a new one)."""
        for _, stream in self._open.values():
            stream.close()


Handle = Callable[[peer_pb2.StepMessage], Awaitable[tuple[grpc.StatusCode, str]]]


async def answers(requests: AsyncIterator[peer_pb2.StepMessage], handle: Handle,
                  until: asyncio.Event | None = None) -> AsyncIterator[peer_pb2.StepAnswer]:
    """The receiving end of one stream: each message handled by `handle` (which gives
    the status its call would have ended with), at most MAX_IN_FLIGHT at once, and
    answered as soon as it is done. The stream ends when its sender ends it, or when
    `until` is set (this daemon stops: its senders then see the stream end)."""
    done: asyncio.Queue[peer_pb2.StepAnswer | None] = asyncio.Queue()
    room = asyncio.Semaphore(MAX_IN_FLIGHT)
    handling: set[asyncio.Task[None]] = set()

    async def one(message: peer_pb2.StepMessage) -> None:
        try:
            code, details = await handle(message)
        except Exception as exc:  # answered as a call's guard would
            code, details = escaped("the step message", exc)
        finally:
            room.release()
        done.put_nowait(peer_pb2.StepAnswer(seq=message.seq, code=code.value[0],
                                            details=details))

    async def read() -> None:
        try:
            async for message in requests:
                await room.acquire()
                task = asyncio.create_task(one(message))
                handling.add(task)
                task.add_done_callback(handling.discard)
            if handling:
                await asyncio.wait(handling)  # (a cancelled wait leaves them running)
        finally:
            done.put_nowait(None)

    async def end_when_set(event: asyncio.Event) -> None:
        await event.wait()
        done.put_nowait(None)

    reader = asyncio.create_task(read())
    watcher = None if until is None else asyncio.create_task(end_when_set(until))
    try:
        while (answer := await done.get()) is not None:
            yield answer
        if not reader.done():
            # This daemon stops: it takes no more messages, and answers those it is
            # handling before the call ends (the server's stop grace bounds the wait).
            reader.cancel()
            if handling:
                await asyncio.wait(set(handling))  # each queues its answer, then ends
            while not done.empty():
                if (answer := done.get_nowait()) is not None:
                    yield answer
            return
        await reader  # what ended the reading (a malformed message aborts the call)
    except asyncio.CancelledError:
        # The call was cancelled (its server stops): end it as a call that returned,
        # the one way gRPC does not print a traceback for it.
        return
    finally:
        # A message being handled when the stream ends is finished all the same (a
        # commit is not left half done); only its answer is lost.
        reader.cancel()
        if watcher is not None:
            watcher.cancel()
