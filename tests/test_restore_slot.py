"""A restore reaches the rank the way a capture leaves it: in a shared-memory slot the
daemon fills and the rank maps (one copy into the model), handed out once; where the
slot budget has no room for it, over the stream as before. Bitwise either way. A real
daemon; this process is its registered rank."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from stalwart.bench.capture import _DaemonRank
from stalwart.client.shm import MappedSlot, SlotRefused
from stalwart.client.state_layout import StateTensor, describe, unpack
from stalwart.v1 import rank_pb2

pytestmark = pytest.mark.multiprocess


def state() -> list[StateTensor]:
    g = torch.Generator().manual_seed(3)
    return [StateTensor("model/w", torch.randn(512, 256, generator=g)),
            StateTensor("optim/w/exp_avg", torch.randn(512, 256, generator=g)),
            StateTensor("model/b", torch.randn(7, generator=g).to(torch.bfloat16)),
            StateTensor("rng/cpu", g.get_state())]


def committed_rank(tmp_path: Path, settings: dict | None = None) -> _DaemonRank:
    """A one-daemon job whose only rank is this process, with `state()` committed as step 1."""
    rank = _DaemonRank(tmp_path / "cluster", settings)
    rank.capturer.capture(1, state(), {"step": 1}, final=True)
    rank.capturer.drain()
    rank.wait_committed(1, timeout_s=60.0)
    return rank


def same(record, data) -> bool:
    got = unpack(data, record.tensors)
    del data  # the tensors are the rank's own: the slot may go
    torch.set_rng_state(got["rng/cpu"])  # as a rank restoring its generator does
    return sorted(got) == sorted(t.name for t in state()) and all(
        torch.equal(got[t.name], t.tensor) for t in state())


def test_a_restore_arrives_in_a_slot_mapped_once_and_equals_the_stream(tmp_path: Path) -> None:
    rank = committed_rank(tmp_path)
    client = rank.client
    try:
        record, data = client.restore(1, 0)
        assert isinstance(data, mmap.mmap) and same(record, data)
        streamed_record, streamed = client.restore(1, 0, into_slot=False)
        assert isinstance(streamed, bytearray) and same(streamed_record, streamed)
        # The slot is handed out once: its id names nothing afterwards.
        [first] = client.call("restore", "Restore", rank_pb2.RestoreRequest(
            rank_id=client.rank_id, step=1, rank=0, into_slot=True))
        assert first.slot_id and not first.data
        MappedSlot.attach(first.fd_socket, first.slot_id, client.token).close()
        with pytest.raises(SlotRefused, match="unknown slot"):
            MappedSlot.attach(first.fd_socket, first.slot_id, client.token)
    finally:
        rank.close()


def test_without_room_for_a_slot_the_state_is_streamed(tmp_path: Path) -> None:
    _, nbytes = describe(state())
    pages = mmap.PAGESIZE * -(-nbytes // mmap.PAGESIZE)
    # Room for the two capture slots and no more.
    rank = committed_rank(tmp_path, {"snapshot": {"slot_bytes": 2 * pages}})
    client = rank.client
    try:
        record, data = client.restore(1, 0)
        assert isinstance(data, bytearray) and same(record, data)
    finally:
        rank.close()


def test_a_slot_this_process_cannot_map_falls_back_to_the_stream(tmp_path: Path,
                                                                  monkeypatch) -> None:
    import stalwart.client.daemon_client as daemon_client

    rank = committed_rank(tmp_path)
    client = rank.client
    try:
        def refused(*_args, **_kw):
            raise SlotRefused("daemon refused slot: as a pid namespace apart would")

        monkeypatch.setattr(daemon_client.MappedSlot, "attach", refused)
        record, data = client.restore(0, 0)  # the newest step: the fallback keeps it
        assert record.rank == 0 and isinstance(data, bytearray) and same(record, data)
    finally:
        rank.close()
