"""A restore started as a plan arrives is taken by the program's own restore when it
asks for the same, and cancelled otherwise (the daemon's stream is let go)."""

from __future__ import annotations

import threading

import pytest

from stalwart.client.daemon_env import DaemonUnavailable
from stalwart.client.generation import Generation, RestoreAhead
from stalwart.v1 import common_pb2, manifest_pb2


class Call:
    """A streaming call that ends when cancelled (or when let through)."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.through = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


class Daemon:
    """The restore side of a DaemonClient: one call per restore, served on demand."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, Call]] = []
        self.arrived = threading.Semaphore(0)  # released once per call started

    def restore(self, step, rank, layers=None, on_call=None):
        call = Call()
        self.calls.append(((step, rank, layers), call))
        if on_call is not None:
            on_call(call)
        self.arrived.release()
        for _ in range(3000):
            if call.cancelled.wait(0.01):
                raise DaemonUnavailable(f"restore of step {step} rank {rank} failed: "
                                        "CANCELLED")
            if call.through.is_set():
                state = manifest_pb2.RankState(extra=b'{"step": %d}' % step)
                return state, bytearray()
        raise AssertionError("neither cancelled nor let through")


def generation(daemon: Daemon, ahead: RestoreAhead) -> Generation:
    gen = Generation(common_pb2.Plan(generation=2), common_pb2.RankAssignment(), None,
                     None, {}, ahead=ahead)
    gen.__dict__["_daemon"] = daemon
    return gen


@pytest.fixture
def daemon(monkeypatch) -> Daemon:
    d = Daemon()
    monkeypatch.setattr(Generation, "daemon", property(lambda self: self._daemon))
    return d


def test_the_program_takes_the_restore_it_asked_for_ahead(daemon: Daemon) -> None:
    ahead = RestoreAhead(daemon, 7, 1, (0, 3))
    gen = generation(daemon, ahead)
    assert daemon.arrived.acquire(timeout=30)
    daemon.calls[0][1].through.set()
    metas, tensors, extra = gen.restore_rank(7, 1, (0, 3))
    assert extra == {"step": 7} and gen.record["restored_ahead"]
    assert len(daemon.calls) == 1  # no second fetch


def test_a_restore_asked_otherwise_cancels_the_one_ahead(daemon: Daemon) -> None:
    ahead = RestoreAhead(daemon, 7, 1, (0, 3))
    gen = generation(daemon, ahead)
    assert daemon.arrived.acquire(timeout=30)
    fetched: list = []
    other = threading.Thread(target=lambda: fetched.append(gen.restore_rank(7, 0, (0, 3))))
    other.start()
    first = daemon.calls[0][1]
    assert first.cancelled.wait(30)  # the stream ahead is let go...
    with pytest.raises(DaemonUnavailable, match="CANCELLED"):
        ahead.result.result(timeout=30)
    assert daemon.arrived.acquire(timeout=30)  # ...and the program's own is served
    assert daemon.calls[1][0] == (7, 0, (0, 3))
    daemon.calls[1][1].through.set()
    other.join(30)
    assert fetched and not gen.record.get("restored_ahead")


def test_a_restore_cancelled_before_its_call_starts_is_cancelled_as_it_starts() -> None:
    gate = threading.Event()

    class Slow(Daemon):
        def restore(self, step, rank, layers=None, on_call=None):
            assert gate.wait(30)
            return super().restore(step, rank, layers, on_call)

    slow = Slow()
    ahead = RestoreAhead(slow, 7, 1, None)
    ahead.cancel()
    gate.set()
    with pytest.raises(DaemonUnavailable, match="CANCELLED"):
        ahead.result.result(timeout=30)
    assert slow.calls[0][1].cancelled.is_set()
