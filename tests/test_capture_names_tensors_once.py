"""A rank names its tensors once per layout: the captures after the first leave them out
(`same_tensors`) and the daemon fills them in from the last one it took, so each step
still commits and restores bitwise. A real daemon; this process is its registered rank."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from stalwart.bench.capture import _DaemonRank
from stalwart.client.daemon_env import DaemonUnavailable
from stalwart.client.state_layout import StateTensor, describe, unpack
from stalwart.v1 import rank_pb2

pytestmark = pytest.mark.multiprocess


def state(step: int) -> list[StateTensor]:
    g = torch.Generator().manual_seed(step)
    return [StateTensor("model/w", torch.randn(64, 32, generator=g)),
            StateTensor("optim/w/exp_avg", torch.randn(64, 32, generator=g)),
            StateTensor("model/b", torch.randn(7, generator=g).to(torch.bfloat16))]


def test_captures_after_the_first_leave_the_tensors_out_and_restore_bitwise(
        tmp_path: Path) -> None:
    rank = _DaemonRank(tmp_path / "cluster")
    sent: list[rank_pb2.CaptureRequest] = []
    call = rank.client.call

    def spy(what, method, request, **kwargs):
        if method == "Capture":
            sent.append(request)
        return call(what, method, request, **kwargs)

    rank.client.call = spy
    try:
        for step in (1, 2, 3):
            rank.capturer.capture(step, state(step), {"step": step}, final=step == 3)
        rank.capturer.drain()
        rank.wait_committed(3, timeout_s=60.0)
        assert [(r.same_tensors, len(r.tensors)) for r in sent] == [(False, 3), (True, 0),
                                                                   (True, 0)]
        for step in (2, 3):
            record, data = rank.client.restore(step, 0)
            got = unpack(data, record.tensors)
            del data
            assert [t.name for t in record.tensors] == [t.name for t in state(step)]
            assert all(torch.equal(got[t.name], t.tensor) for t in state(step))
    finally:
        rank.close()


def test_a_daemon_that_holds_no_tensors_for_the_rank_asks_for_them(tmp_path: Path) -> None:
    rank = _DaemonRank(tmp_path / "cluster")
    client, transport = rank.client, rank.transport
    try:
        metas, nbytes = describe(state(1))
        [(slot_id, _)] = transport.open_slots(nbytes)[:1]

        def capture(**fields) -> None:
            client.call("capture", "Capture", rank_pb2.CaptureRequest(
                rank_id=client.rank_id, generation=transport.generation, step=1,
                slot_id=slot_id, coord=transport.coord, layout=transport.layout, **fields))

        with pytest.raises(DaemonUnavailable, match="send them") as refused:
            capture(same_tensors=True)
        assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(DaemonUnavailable, match="not both") as both:
            capture(same_tensors=True, tensors=metas)
        assert both.value.code is grpc.StatusCode.INVALID_ARGUMENT
        # The transport believes the daemon holds them: refused, it names them in full.
        transport._named = metas  # noqa: SLF001 - the state a forgetful daemon leaves it in
        transport.send_capture(1, slot_id, metas, b"{}")
        assert transport._named is metas  # noqa: SLF001
    finally:
        rank.close()
