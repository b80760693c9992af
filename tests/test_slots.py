"""Shared-memory slots: a daemon-owned memfd reaches a rank by fd and is shared."""

import multiprocessing as mp

import pytest

from stalwart.client.shm import MappedSlot, SlotRefused
from stalwart.daemon.snapshot.slots import FdServer, SlotError, SlotPool


@pytest.fixture
def fd_server(tmp_path):
    pool = SlotPool(budget_bytes=64 << 20, token="job-secret")
    server = FdServer(pool, tmp_path / "fd.sock")
    server.start()
    yield pool, server
    server.stop()
    pool.close()


def _write_from_child(sock_path: str, slot_id: str, token: str, payload: bytes) -> None:
    slot = MappedSlot.attach(sock_path, slot_id, token)
    slot.view[: len(payload)] = payload
    slot.close()


def test_bytes_written_by_another_process_are_seen_by_the_daemon(fd_server):
    pool, server = fd_server
    slot = pool.open("rank-0", 10_000)[0]
    payload = bytes(range(256)) * 8
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_write_from_child,
                        args=(str(server.path), slot.slot_id, "job-secret", payload))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert bytes(slot.view[: len(payload)]) == payload


def test_slot_survives_the_writer_closing_its_mapping(fd_server):
    pool, server = fd_server
    slot = pool.open("rank-0", 4096)[0]
    mapped = MappedSlot.attach(server.path, slot.slot_id, "job-secret")
    mapped.view[:5] = b"hello"
    mapped.close()
    assert bytes(slot.view[:5]) == b"hello"


def test_wrong_token_is_refused(fd_server):
    pool, server = fd_server
    slot = pool.open("rank-0", 4096)[0]
    with pytest.raises(SlotRefused, match="token"):
        MappedSlot.attach(server.path, slot.slot_id, "not-the-token")


def test_unknown_slot_is_refused_with_its_id(fd_server):
    _, server = fd_server
    with pytest.raises(SlotRefused, match="deadbeef"):
        MappedSlot.attach(server.path, "deadbeef", "job-secret")


def test_slots_are_reused_when_large_enough(fd_server):
    pool, _ = fd_server
    first = pool.open("rank-0", 8192)
    again = pool.open("rank-0", 4096)
    assert [s.slot_id for s in again] == [s.slot_id for s in first]


def test_budget_is_enforced_with_a_clear_message(fd_server):
    pool, _ = fd_server
    pool.open("rank-0", 16 << 20)
    with pytest.raises(SlotError, match="budget exceeded"):
        pool.open("rank-1", 24 << 20)
