"""A server interceptor that gives every malformed or unexpected call a meaningful status.

Undecodable request bytes become INVALID_ARGUMENT (gRPC itself would answer UNKNOWN
or INTERNAL), and an exception that escapes a handler becomes INTERNAL with the
method named and the error logged, never UNKNOWN: callers can tell a refused
request from a daemon bug, and a fuzzer can count both.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc._cython import cygrpc

from stalwart.daemon.errors import disk_full

log = logging.getLogger("stalwart.daemon.rpc.guard")


class _Undecodable:
    """Stands in for a request whose bytes are not a valid message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except Exception as exc:  # protobuf raises DecodeError, or others for odd bytes
            return _Undecodable(exc)
    return parse


async def _refuse_undecodable(context: grpc.aio.ServicerContext, method: str,
                              request: Any) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{method}: the request bytes are not a valid message "
                            f"({type(request.error).__name__}); send the protobuf of this RPC")


async def _internal(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    # The caller cancelled or went away (a killed rank, a peer that gave up): what failed
    # after that has no one to answer. gRPC may not know it yet (not cancelled) when the
    # handler's own answer fails to send: gRPC raises its own error from the call then
    # (cygrpc's, never a handler's), and the call is not to be aborted again.
    if context.cancelled() or isinstance(exc, cygrpc.BaseError):
        log.info("%s ended after its caller went away (%s: %s)", method,
                 type(exc).__name__, exc)
        return
    await context.abort(*escaped(method, exc))


def escaped(what: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status an error that escaped the handler of `what` answers with, logged:
    RESOURCE_EXHAUSTED where it is this node's full disk (a condition of the node, said
    without a traceback), else INTERNAL (a daemon bug, its traceback in the log)."""
    if (full := disk_full(exc)) is not None:
        log.warning("%s refused: %s", what, full)
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: {full}"
    log.exception("unexpected error in %s", what, exc_info=exc)
    return grpc.StatusCode.INTERNAL, (f"{what} failed inside the daemon "
                                      f"({type(exc).__name__}: {exc}); see the daemon log")


_PASS = (grpc.aio.AbortError, asyncio.CancelledError)


class _UndecodablePiece(Exception):
    """A piece of a request stream whose bytes are not a valid message. Raised where the
    stream is read, which may be a task of the handler's own (StepStream's reader);
    the call is aborted from the handler's task, the one place gRPC allows it."""


def _checked_stream(requests: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async def pieces() -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Undecodable):
                raise _UndecodablePiece(
                    f"{method}: a piece of the request stream is not a valid message "
                    f"({type(request.error).__name__}); send the protobuf of this RPC")
            yield request
    return pieces()


def _guard_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse = _lenient(handler.request_deserializer)
    serialize = handler.response_serializer

    async def call(fn: Callable[..., Any], request: Any, context: Any) -> Any:
        try:
            return await fn(request, context)
        except _PASS:
            raise
        except _UndecodablePiece as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            await _internal(context, method, exc)

    async def stream(fn: Callable[..., Any], request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            out = fn(request, context)
            if inspect.isawaitable(out):  # a handler that writes with context.write
                await out
                return
            async for response in out:
                yield response
        except _PASS:
            raise
        except _UndecodablePiece as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            await _internal(context, method, exc)

    if handler.unary_unary is not None:
        fn: Callable[..., Awaitable[Any]] = handler.unary_unary

        async def unary_unary(request: Any, context: Any) -> Any:
            await _refuse_undecodable(context, method, request)
            return await call(fn, request, context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, parse, serialize)
    if handler.unary_stream is not None:
        fn = handler.unary_stream

        async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            await _refuse_undecodable(context, method, request)
            async for response in stream(fn, request, context):
                yield response
        return grpc.unary_stream_rpc_method_handler(unary_stream, parse, serialize)
    if handler.stream_unary is not None:
        fn = handler.stream_unary

        async def stream_unary(requests: Any, context: Any) -> Any:
            return await call(fn, _checked_stream(requests, method), context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, parse, serialize)
    fn = handler.stream_stream

    async def stream_stream(requests: Any, context: Any) -> AsyncIterator[Any]:
        async for response in stream(fn, _checked_stream(requests, method), context):
            yield response
    return grpc.stream_stream_rpc_method_handler(stream_stream, parse, serialize)


class Guard(grpc.aio.ServerInterceptor):
    """Install with grpc.aio.server(interceptors=[Guard()])."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _guard_handler(handler, handler_call_details.method)
