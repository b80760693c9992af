"""Step messages on streams held open (daemon/rpc/step_stream.py), against a peer in its
own process over real gRPC: each message is answered as its call would be, by number
and in any order, on one stream; a peer killed or stopped fails what waits on it, and
the next message goes on a new stream; a peer without the stream gets unary calls."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from stalwart.daemon.rpc.step_stream import COMMIT, StepStreams
from stalwart.v1 import manifest_pb2, peer_pb2

PEER = Path(__file__).with_name("step_stream_peer.py")
WAIT_S = 30.0  # deadline of every wait: generous for a loaded 2-core machine


def start_peer(port: int = 0, *flags: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, str(PEER), str(port), *flags],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # the peer prints once it serves, or exits
    if not line.startswith("ready "):
        proc.kill()
        raise AssertionError(f"the test peer did not start: {line!r}")
    return proc, int(line.split()[1])


@pytest.fixture
def peer():
    procs = []

    def start(port: int = 0, *flags: str) -> tuple[subprocess.Popen, int]:
        proc, bound = start_peer(port, *flags)
        procs.append(proc)
        return proc, bound
    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()


def commit(step: int) -> bytes:
    return peer_pb2.CommitStepRequest(
        record=manifest_pb2.StepRecord(job_id="j", step=step)).SerializeToString()


async def stats(channel: grpc.aio.Channel) -> dict:
    return json.loads(await channel.unary_unary("/test.Peer/Stats")(b"", timeout=WAIT_S))


async def until(check, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT_S
    while not await check():
        if loop.time() > end:
            raise AssertionError(f"timed out after {WAIT_S:g} s waiting for {what}")
        await asyncio.sleep(0.02)


async def code_of(send) -> str:
    try:
        await send
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    return "OK"


def test_messages_are_answered_by_number_in_any_order_and_a_refusal_as_its_call(peer) -> None:
    _, port = peer()

    async def body() -> tuple[list[str], dict]:
        streams = StepStreams()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            # 4 is answered only after 5: a message waiting does not hold up the next.
            got = await asyncio.gather(*(code_of(streams.send(channel, COMMIT, commit(s),
                                                               WAIT_S))
                                         for s in (1, 4, 5, 2)))
            return got, await stats(channel)

    got, seen = asyncio.run(body())
    assert got == ["OK", "OK", "OK", "PERMISSION_DENIED: step 2 is refused here"]
    assert seen["answered"].index(5) < seen["answered"].index(4)
    assert (seen["streams"], seen["unary"]) == (1, 0)  # four messages, one stream


def test_a_peer_killed_fails_what_waits_at_once_and_the_next_goes_on_a_new_stream(
        peer) -> None:
    proc, port = peer()

    async def body() -> tuple[str, float, str, dict]:
        streams = StepStreams()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            loop = asyncio.get_running_loop()
            held = asyncio.ensure_future(code_of(streams.send(channel, COMMIT, commit(3),
                                                              timeout=600)))
            await until(lambda: _held(channel), "the peer to hold step 3")
            proc.kill()  # kill -9
            t0 = loop.time()
            failed = await asyncio.wait_for(held, WAIT_S)
            took = loop.time() - t0
            await loop.run_in_executor(None, proc.wait)
            peer(port)  # the daemon back on its port
            again = await code_of(streams.send(channel, COMMIT, commit(1), WAIT_S))
            return failed, took, again, await stats(channel)

    failed, took, again, seen = asyncio.run(body())
    assert failed.startswith("UNAVAILABLE") and took < WAIT_S  # not its 600 s timeout
    assert again == "OK" and seen["streams"] == 1 and seen["answered"] == [1]


async def _held(channel: grpc.aio.Channel) -> bool:
    return (await stats(channel))["held"] == 1


def test_a_stopped_peer_times_out_the_message_and_ends_its_stream(peer) -> None:
    proc, port = peer()

    async def body() -> tuple[str, str, dict]:
        streams = StepStreams()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await code_of(streams.send(channel, COMMIT, commit(1), WAIT_S)) == "OK"
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                stuck = await code_of(streams.send(channel, COMMIT, commit(6), timeout=1.0))
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            after = await code_of(streams.send(channel, COMMIT, commit(7), WAIT_S))
            return stuck, after, await stats(channel)

    stuck, after, seen = asyncio.run(body())
    assert stuck == "DEADLINE_EXCEEDED: no answer on the step stream within 1 s"
    assert after == "OK" and seen["streams"] == 2  # the stuck stream was ended


def test_a_peer_without_the_stream_gets_unary_calls(peer) -> None:
    _, port = peer(0, "--unary-only")

    async def body() -> tuple[list[str], dict]:
        streams = StepStreams()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            got = [await code_of(streams.send(channel, COMMIT, commit(s), WAIT_S))
                   for s in (1, 2, 5)]
            return got, await stats(channel)

    got, seen = asyncio.run(body())
    assert got == ["OK", "PERMISSION_DENIED: step 2 is refused here", "OK"]
    assert (seen["streams"], seen["unary"]) == (0, 3)
