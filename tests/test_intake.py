"""Specification of intake, the snapshot path's first stage, through a real daemon's RPCs:
each refusal is the status code of its kind, with a message that says what to do."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
from fixtures_hostile import TOKEN, code_of, config, run, until

from stalwart.daemon.server import Daemon
from stalwart.daemon.snapshot.intake import MAX_BACKLOG
from stalwart.v1 import common_pb2, rank_pb2, rank_pb2_grpc

META = (("stalwart-token", TOKEN),)


async def capture_codes(daemon: Daemon) -> dict[str, str]:
    """Register two ranks, open a slot for the first, then capture in four wrong ways."""
    async with grpc.aio.insecure_channel(daemon.address) as ch:
        stub = rank_pb2_grpc.RankServiceStub(ch)

        async def register(pid: int) -> str:
            reply = await stub.Register(rank_pb2.RegisterRequest(
                pid=pid, rank=0, world_size=1), metadata=META, timeout=10)
            return reply.rank_id

        mine, other = await register(os.getpid()), await register(os.getppid())
        slot = await stub.OpenSlot(rank_pb2.OpenSlotRequest(rank_id=mine, nbytes=4096),
                                   metadata=META, timeout=10)
        tensor = common_pb2.TensorMeta(name="w", offset=0, nbytes=4096)
        daemon.registry.install_plan(common_pb2.Plan(generation=2))

        async def code(**fields) -> str:
            request = rank_pb2.CaptureRequest(rank_id=mine, generation=2, step=1,
                                              slot_id=slot.slot_id, tensors=[tensor])
            for name, value in fields.items():
                if name == "tensors":
                    del request.tensors[:]
                    request.tensors.extend(value)
                else:
                    setattr(request, name, value)
            try:
                await stub.Capture(request, metadata=META, timeout=10)
            except grpc.aio.AioRpcError as e:
                return f"{e.code().name}: {e.details()}"
            return "OK"

        return {
            "stale": await code(generation=1),
            "unknown slot": await code(slot_id="0123456789abcdef"),
            "another's slot": await code(rank_id=other),
            "too large": await code(tensors=[common_pb2.TensorMeta(
                name="w", offset=0, nbytes=slot.size + 1)]),
            "fine": await code(),
        }


def test_a_capture_is_refused_by_kind_and_a_good_one_is_taken(tmp_path: Path) -> None:
    codes = run(config(tmp_path), capture_codes)
    assert codes["stale"].startswith("ABORTED: capture of step 1 is from generation 1, but "
                                     "the job is at generation 2; follow the current plan")
    assert codes["unknown slot"].startswith("NOT_FOUND: unknown slot")
    assert codes["another's slot"].startswith("PERMISSION_DENIED: slot ")
    assert codes["too large"].startswith("INVALID_ARGUMENT: tensors describe")
    assert codes["fine"] == "OK"


async def open_for_a_stranger(daemon: Daemon) -> str:
    async with grpc.aio.insecure_channel(daemon.address) as ch:
        stub = rank_pb2_grpc.RankServiceStub(ch)
        try:
            await stub.OpenSlot(rank_pb2.OpenSlotRequest(rank_id="n1/1", nbytes=4096),
                                metadata=META, timeout=10)
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
    return "OK"


def test_a_slot_is_only_for_a_registered_rank(tmp_path: Path) -> None:
    assert run(config(tmp_path), open_for_a_stranger) == (
        "NOT_FOUND: rank 'n1/1' is not registered with n1; call Register first")


async def slots_freed_under_a_waiting_capture(daemon: Daemon) -> tuple[str, int]:
    """A rank dies with a capture in flight: the capture waits for room behind a full
    backlog while the rank's slots are freed (what forget_rank does once its death is
    seen), then gets its turn."""
    async with grpc.aio.insecure_channel(daemon.address) as ch:
        stub = rank_pb2_grpc.RankServiceStub(ch)
        reply = await stub.Register(rank_pb2.RegisterRequest(pid=os.getpid(), rank=0,
                                                             world_size=1),
                                    metadata=META, timeout=10)
        rank = reply.rank_id
        slot = await stub.OpenSlot(rank_pb2.OpenSlotRequest(rank_id=rank, nbytes=4096),
                                   metadata=META, timeout=10)
        daemon.registry.install_plan(common_pb2.Plan(generation=2))
        intake = daemon.job.snapshots.intake
        intake._backlog[rank] = MAX_BACKLOG  # encoding is a full backlog behind
        call = asyncio.ensure_future(stub.Capture(rank_pb2.CaptureRequest(
            rank_id=rank, generation=2, step=7, slot_id=slot.slot_id,
            tensors=[common_pb2.TensorMeta(name="w", offset=0, nbytes=4096)]),
            metadata=META, timeout=10))
        await until(lambda: rank in intake._taking_of, "the capture to wait for room")
        await asyncio.to_thread(daemon.job.snapshots.pool.drop_rank, rank)
        async with intake._encoded:
            intake._backlog[rank] = 0
            intake._encoded.notify_all()
        return await code_of(call), intake._backlog[rank]


def test_a_capture_whose_rank_died_and_slots_were_freed_is_dropped_with_its_reason(
        tmp_path: Path) -> None:
    code, backlog = run(config(tmp_path), slots_freed_under_a_waiting_capture)
    assert code.startswith("NOT_FOUND: rank ") and code.endswith(
        "is gone and its slots are freed; its capture of step 7 was not taken")
    assert backlog == 0  # its room in the backlog is given back
