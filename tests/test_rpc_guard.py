"""The guard's answer to an exception that escapes a handler (`daemon/rpc/guard.py`):
INTERNAL with the error logged, unless the caller already went away or the error is
this node's full disk (RESOURCE_EXHAUSTED, saying so). Pure logic with
a stand-in for gRPC's servicer context."""

from __future__ import annotations

import asyncio
import errno
import logging

import grpc
import pytest

from stalwart.daemon.rpc import guard


class Context:
    def __init__(self, cancelled: bool) -> None:
        self._cancelled, self.aborted = cancelled, []

    def cancelled(self) -> bool:
        return self._cancelled

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        if self._cancelled:  # as gRPC does on a call whose caller has gone
            raise RuntimeError("Failed execute_batch")
        self.aborted.append((code, details))


def test_a_handler_error_is_internal_and_logged(caplog: pytest.LogCaptureFixture):
    ctx = Context(cancelled=False)
    with caplog.at_level(logging.ERROR, "stalwart.daemon.rpc.guard"):
        asyncio.run(guard._internal(ctx, "/stalwart.v1.ShardService/PutShard",
                                    ValueError("bad")))
    assert ctx.aborted and ctx.aborted[0][0] is grpc.StatusCode.INTERNAL
    assert "unexpected error" in caplog.text


def test_an_error_after_the_caller_went_away_is_no_daemon_error(
        caplog: pytest.LogCaptureFixture):
    # A put whose caller (a killed rank's daemon, a peer that gave up) cancelled it ends
    # in an abort that gRPC refuses: not an error of this daemon, and not aborted again.
    ctx = Context(cancelled=True)
    with caplog.at_level(logging.INFO, "stalwart.daemon.rpc.guard"):
        asyncio.run(guard._internal(ctx, "/stalwart.v1.ShardService/PutShard",
                                    RuntimeError("Failed execute_batch")))
    assert ctx.aborted == []
    assert "caller went away" in caplog.text and "unexpected error" not in caplog.text


def test_an_answer_that_failed_to_send_is_not_answered_again(
        caplog: pytest.LogCaptureFixture):
    # A capture whose rank was killed meanwhile: the handler's own abort fails to send
    # before gRPC marks the call cancelled. A second abort would be refused ("Abort
    # already called!") and logged as a daemon bug.
    from grpc._cython import cygrpc

    ctx = Context(cancelled=False)
    with caplog.at_level(logging.INFO, "stalwart.daemon.rpc.guard"):
        asyncio.run(guard._internal(ctx, "/stalwart.v1.RankService/Capture",
                                    cygrpc.ExecuteBatchError('Failed "execute_batch"')))
    assert ctx.aborted == []
    assert "caller went away" in caplog.text and "unexpected error" not in caplog.text


def test_a_full_disk_is_resource_exhausted_and_says_so(caplog: pytest.LogCaptureFixture):
    ctx = Context(cancelled=False)
    full = OSError(errno.ENOSPC, "No space left on device", "/data/manifests/7.step.tmp")
    with caplog.at_level(logging.INFO, "stalwart.daemon.rpc.guard"):
        asyncio.run(guard._internal(ctx, "/stalwart.v1.PeerService/PutRecords", full))
    [(code, details)] = ctx.aborted
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "disk is full" in details and "/data/manifests/7.step.tmp" in details
    assert "unexpected error" not in caplog.text  # a condition of the node, not a bug


def test_another_os_error_is_still_internal():
    ctx = Context(cancelled=False)
    asyncio.run(guard._internal(ctx, "/stalwart.v1.PeerService/PutRecords",
                                OSError(errno.EIO, "Input/output error")))
    assert [code for code, _ in ctx.aborted] == [grpc.StatusCode.INTERNAL]
