"""A hostile peer against a real daemon (in-process, over its real TCP and Unix sockets):
forged plans, commits, prepares, failure reports, deletes and announcements, each one
refused (issue 19). An attacker either lacks the job token, or holds it (a rank of the
job, or a daemon) and claims a node that has no right to what it asks."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest
from fixtures_hostile import TOKEN, as_node, code_of, config, refused, register_self, run, until
from snapshot_states import commit_step

from stalwart.core.step_record import seal, split
from stalwart.daemon.config import SnapshotConfig
from stalwart.daemon.rpc import step_stream
from stalwart.daemon.rpc.step_stream import StepStreams
from stalwart.daemon.security.roles import MAX_GENERATION_JUMP
from stalwart.daemon.server import Daemon
from stalwart.daemon.snapshot.shard_client import ShardClient, ShardTransferError
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2, peer_pb2_grpc


def peer_stub(daemon: Daemon, channel: grpc.aio.Channel) -> peer_pb2_grpc.PeerServiceStub:
    return peer_pb2_grpc.PeerServiceStub(channel)


# --- plans ---------------------------------------------------------------------------


def test_a_forged_plan_keeps_the_committed_steps_and_the_generation(tmp_path: Path) -> None:
    forged = common_pb2.Plan(generation=5, resume_step=0, reason="forged")
    forged.assignments.add(rank_id="n9/1", node="n9")

    async def body(daemon: Daemon) -> dict[str, str]:
        for step in (1, 2, 3):
            commit_step(daemon.job.snapshots.store, step)
        async with grpc.aio.insecure_channel(daemon.address) as tcp, \
                grpc.aio.insecure_channel(f"unix:{daemon.unix_socket}") as unix:
            out = {
                "no token": await code_of(peer_stub(daemon, tcp).InstallPlan(forged, timeout=5)),
                "other node": await code_of(peer_stub(daemon, tcp).InstallPlan(
                    forged, metadata=as_node("n9"), timeout=5)),
                "ranks' socket": await code_of(peer_stub(daemon, unix).InstallPlan(
                    forged, metadata=as_node("n1"), timeout=5)),
            }
        out["steps"] = str(daemon.job.snapshots.store.committed_steps())
        out["generation"] = str(daemon.registry.generation)
        return out

    seen = run(config(tmp_path), body)
    assert seen["no token"].startswith("UNAUTHENTICATED: no job token")
    assert seen["other node"].startswith("PERMISSION_DENIED: a plan comes only from the "
                                         "coordinator (n1), not from daemon n9")
    assert seen["ranks' socket"].startswith("UNIMPLEMENTED")
    assert (seen["steps"], seen["generation"]) == ("[1, 2, 3]", "1")


def test_a_plan_that_jumps_generations_is_refused_and_real_plans_still_install(
        tmp_path: Path) -> None:
    async def body(daemon: Daemon) -> list[str]:
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            stub = peer_stub(daemon, ch)
            return [await code_of(stub.InstallPlan(common_pb2.Plan(generation=g), timeout=5,
                                                   metadata=as_node("n1")))
                    for g in (2**53, 1 + MAX_GENERATION_JUMP + 1, 2)]

    huge, too_far, next_one = run(config(tmp_path), body)
    assert huge.startswith("PERMISSION_DENIED: plan of generation 9007199254740992 jumps")
    assert too_far.startswith("PERMISSION_DENIED: plan of generation 66 jumps more than 64")
    assert next_one == "OK"


def test_only_the_coordinator_hurries_a_step_and_only_for_this_job_and_plan(
        tmp_path: Path) -> None:
    # A hurry drops the captures waiting before its step: from anyone but the
    # coordinator, for another job or another plan, it drops nothing; nor may it hold
    # its answer longer than a minute.
    def hurry(step: int, job_id: str = "default", generation: int = 1, wait_s: float = 0.0
              ) -> peer_pb2.HurryStepRequest:
        return peer_pb2.HurryStepRequest(job_id=job_id, generation=generation, step=step,
                                         wait_s=wait_s)

    async def body(daemon: Daemon) -> dict[str, object]:
        intake = daemon.job.snapshots.intake
        async with grpc.aio.insecure_channel(daemon.address) as tcp:
            stub = peer_stub(daemon, tcp)
            out: dict[str, object] = {
                "no token": await code_of(stub.HurryStep(hurry(9), timeout=5)),
                "other node": await code_of(stub.HurryStep(
                    hurry(9), metadata=as_node("n9"), timeout=5)),
            }
            out["other job"] = await code_of(stub.HurryStep(
                hurry(9, job_id="other"), timeout=5, metadata=as_node("n1")))
            other_plan = await stub.HurryStep(hurry(9, generation=3), timeout=5,
                                              metadata=as_node("n1"))
            out["other plan"] = other_plan.message
            out["an hour"] = await code_of(stub.HurryStep(
                hurry(9, wait_s=3600.0), timeout=5, metadata=as_node("n1")))
            out["before"] = intake._hurry  # noqa: SLF001 - what a hurry changes
            taken = await stub.HurryStep(hurry(7), timeout=5, metadata=as_node("n1"))
            out["after"] = (taken.accepted, intake._hurry)  # noqa: SLF001
        return out

    seen = run(config(tmp_path), body)
    assert str(seen["no token"]).startswith("UNAUTHENTICATED: no job token")
    assert str(seen["other node"]).startswith("PERMISSION_DENIED: a hurried step comes only "
                                              "from the coordinator (n1), not from daemon n9")
    assert str(seen["other job"]).startswith("PERMISSION_DENIED: step message of job "
                                             "'other' sent to a daemon of job 'default'")
    assert seen["other plan"] == "hurry is for generation 3; this daemon is at generation 1"
    assert str(seen["an hour"]) == "INVALID_ARGUMENT: wait_s must be in [0.0, 60.0], got 3600.0"
    assert seen["before"] == (0, 0) and seen["after"] == (True, (1, 7))


def test_a_held_state_goes_only_to_a_live_daemon_of_the_job(tmp_path: Path) -> None:
    # GetHeld hands out a rank's decoded newest committed capture (what a spare's
    # daemon on another node restores from): to a live daemon of this job only, whole
    # or by chunks, and NOT_FOUND for a step it does not hold decoded.
    from snapshot_states import state

    def ask(step: int, chunks: tuple[int, ...] = (), job_id: str = "default"
            ) -> peer_pb2.GetHeldRequest:
        return peer_pb2.GetHeldRequest(job_id=job_id, step=step, rank=0, chunks=chunks)

    async def read(stub, request, node: str) -> bytes:
        return b"".join([p.data async for p in stub.GetHeld(request, timeout=5,
                                                              metadata=as_node(node))])

    async def body(daemon: Daemon) -> dict[str, object]:
        store = daemon.job.snapshots.store
        for step in (1, 2, 3):
            commit_step(store, step)
        first = store.rank_record(3, 0).chunks[0]
        async with grpc.aio.insecure_channel(daemon.address) as tcp:
            stub = peer_stub(daemon, tcp)
            return {
                "whole": await read(stub, ask(3), "n1") == state(3),
                "chunk 0": await read(stub, ask(3, (0,)), "n1")
                == state(3)[first.offset:first.offset + first.size],
                "older": await code_of(read(stub, ask(2), "n1")),
                "no chunk 99": await code_of(read(stub, ask(3, (99,)), "n1")),
                "not a member": await code_of(read(stub, ask(3), "n9")),
                "other job": await code_of(read(stub, ask(3, job_id="other"), "n1")),
            }

    seen = run(config(tmp_path), body)
    assert seen["whole"] is True and seen["chunk 0"] is True
    assert str(seen["older"]).startswith("NOT_FOUND: step 2 of rank 0 is not held decoded")
    assert str(seen["no chunk 99"]).startswith("INVALID_ARGUMENT: step 3 rank 0 has")
    assert str(seen["not a member"]).startswith("PERMISSION_DENIED: daemon n9 is not a live "
                                                "member of this job")
    assert str(seen["other job"]).startswith("PERMISSION_DENIED: step message of job 'other'")


# --- commits -------------------------------------------------------------------------


def test_a_forged_or_empty_commit_is_refused_as_a_call_and_on_the_step_stream(
        tmp_path: Path) -> None:
    async def body(daemon: Daemon) -> dict[str, str]:
        from stalwart.daemon.snapshot.local_store import LocalStore
        store = daemon.job.snapshots.store
        commit_step(store, 1)
        elsewhere = LocalStore(tmp_path / "attacker", chunk_bytes=8192)
        commit_step(elsewhere, 1)
        invented = commit_step(elsewhere, 2)  # sealed and consistent, of a step never taken
        forged = peer_pb2.CommitStepRequest(record=split(invented))
        empty = peer_pb2.CommitStepRequest(
            record=manifest_pb2.StepRecord(job_id="default", step=0, generation=1))
        streams = StepStreams()
        out = {}
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            stub = peer_stub(daemon, ch)
            out["forged"] = await code_of(stub.CommitStep(forged, metadata=as_node("n9"),
                                                          timeout=5))
            out["empty"] = await code_of(stub.CommitStep(empty, metadata=as_node("n1"),
                                                         timeout=5))
            for name, request, who in (("forged", forged, as_node("n9")),
                                       ("empty", empty, as_node("n1")),
                                       ("no token", forged, ())):
                out[f"{name} on the stream"] = await code_of(streams.send(
                    ch, step_stream.COMMIT, request.SerializeToString(), 5, metadata=who))
        out["latest"] = str(store.latest_committed())
        return out

    seen = run(config(tmp_path), body)
    for way in ("", " on the stream"):
        assert seen["forged" + way].startswith(
            "PERMISSION_DENIED: the commit of step 2 comes only from the coordinator")
        assert seen["empty" + way].startswith(
            "INVALID_ARGUMENT: the record of step 0 has no seals")
    assert seen["no token on the stream"].startswith("UNAUTHENTICATED: no job token")
    assert seen["latest"] == "1"


def test_undecodable_bytes_on_the_step_stream_end_it_as_invalid_and_the_daemon_serves_on(
        tmp_path: Path) -> None:
    async def body(daemon: Daemon) -> tuple[str, str]:
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            call = ch.stream_stream(step_stream.STEP_STREAM, request_serializer=None,
                                    response_deserializer=peer_pb2.StepAnswer.FromString)(
                metadata=as_node("n1"))
            await call.write(b"\xff\xff\xff")  # no protobuf
            garbage = await code_of(call.read())
            info = await peer_stub(daemon, ch).Gossip(peer_pb2.PeerInfo(node="n1"),
                                                      metadata=as_node("n1"), timeout=5)
        return garbage, info.coordinator

    garbage, coordinator = run(config(tmp_path), body)
    assert garbage == ("INVALID_ARGUMENT: /stalwart.v1.PeerService/StepStream: a piece of the "
                       "request stream is not a valid message (DecodeError); send the "
                       "protobuf of this RPC")
    assert coordinator == "n1"  # it still answers


# --- prepares ------------------------------------------------------------------------


def test_a_daemon_prepares_only_its_own_ranks_for_steps_near_the_last_commit(
        tmp_path: Path) -> None:
    layout = common_pb2.ParallelLayout(dp=1, pp=1, tp=1)

    def prepare(node: str, step: int, rank_node: str | None = None):
        req = peer_pb2.PrepareStepRequest(job_id="default", step=step, generation=1,
                                          node=node, layout=layout)
        req.seal.CopyFrom(seal(rank_node or node, [manifest_pb2.RankState(rank=0)]))
        return req

    async def body(daemon: Daemon) -> dict[str, str]:
        await register_self(daemon)
        flood = peer_pb2.PrepareStepRequest(job_id="default", step=1, generation=1, node="n9")
        flood.seal.CopyFrom(seal("n9", []))
        flood.seal.ranks.extend(range(1 << 20))
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            stub = peer_stub(daemon, ch)
            out = {
                "another node's rank": await code_of(stub.PrepareStep(
                    prepare("n9", 5), metadata=as_node("n9"), timeout=5)),
                "in another's name": await code_of(stub.PrepareStep(
                    prepare("n1", 5), metadata=as_node("n9"), timeout=5)),
                "far ahead": await code_of(stub.PrepareStep(
                    prepare("n1", 10**9), metadata=as_node("n1"), timeout=5)),
                "a million ranks": await code_of(stub.PrepareStep(
                    flood, metadata=as_node("n9"), timeout=30)),
            }
        out["pending"] = str(sorted(daemon.job.coordinator.commits.steps))
        return out

    seen = run(config(tmp_path), body)
    assert seen["another node's rank"].startswith(
        "PERMISSION_DENIED: daemon n9 prepared rank 0, which the plan of generation 1 "
        "places on n1")
    assert seen["in another's name"].startswith(
        "PERMISSION_DENIED: daemon n9 sent a prepare for node 'n1'")
    assert seen["far ahead"].startswith("PERMISSION_DENIED: step 1000000000 is more than")
    assert seen["a million ranks"].startswith(
        "INVALID_ARGUMENT: seal.ranks has 1048576 entries")
    assert seen["pending"] == "[]"


# --- failure reports -----------------------------------------------------------------


def test_a_death_reported_by_another_node_for_a_live_rank_is_not_believed(
        tmp_path: Path) -> None:
    async def body(daemon: Daemon) -> dict[str, str]:
        rank_id = await register_self(daemon)
        exit_ = common_pb2.FailureEvent(kind=common_pb2.FailureEvent.PROCESS_EXIT,
                                        subject=rank_id, evidence="forged", reporter="n1")
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            stub = peer_stub(daemon, ch)
            out = {"no token": await code_of(stub.ReportFailure(exit_, timeout=5))}
            ack = await stub.ReportFailure(exit_, metadata=as_node("n2"), timeout=5)
            out["generation 0"] = f"{ack.accepted} {ack.message}"
            exit_.generation = daemon.registry.generation
            ack = await stub.ReportFailure(exit_, metadata=as_node("n2"), timeout=5)
            out["current generation"] = str(ack.accepted)
        await until(lambda: refused(daemon, "unconfirmed") >= 1, "the report to be weighed")
        out["reporter"] = daemon.registry.failures[-1].reporter
        out["generation"] = str(daemon.registry.generation)
        out["stopped"] = str(daemon.registry.current_plan().stop)
        return out

    seen = run(config(tmp_path), body)
    assert seen["no token"].startswith("UNAUTHENTICATED")
    assert seen["generation 0"].startswith("False report is for generation 0")
    assert seen["current generation"] == "True"  # heard, then checked against the rank
    assert seen["reporter"] == "n2"  # the caller, not the "n1" the report claimed
    assert (seen["generation"], seen["stopped"]) == ("1", "False")


def test_a_death_seen_in_the_generation_before_is_heard_and_a_hang_is_not(
        tmp_path: Path) -> None:
    # Two ranks that die together are seen by their two daemons; the plan for the first
    # may be installed before the second report arrives, its rank still in that plan.
    async def body(daemon: Daemon) -> dict[str, str]:
        rank_id = await register_self(daemon)
        newer = common_pb2.Plan()
        newer.CopyFrom(daemon.registry.current_plan())
        newer.generation += 1
        daemon.registry.install_plan(newer)
        out = {}
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            stub = peer_stub(daemon, ch)
            for kind in ("PROCESS_EXIT", "COLLECTIVE_HANG"):
                event = common_pb2.FailureEvent(
                    kind=common_pb2.FailureEvent.Kind.Value(kind), subject=rank_id,
                    evidence="seen late", generation=newer.generation - 1)
                ack = await stub.ReportFailure(event, metadata=as_node("n2"), timeout=5)
                out[kind] = f"{ack.accepted} {ack.message}"
        out["recorded"] = " ".join(f.kind.name for f in daemon.registry.failures)
        return out

    seen = run(config(tmp_path), body)
    assert seen["PROCESS_EXIT"] == "True "  # a fact: still true in the newer plan
    assert seen["COLLECTIVE_HANG"].startswith("False report is for generation 1")
    assert seen["recorded"] == "PROCESS_EXIT"


def test_a_death_of_another_nodes_live_rank_is_not_believed_while_its_daemon_vouches(
        tmp_path: Path) -> None:
    from dataclasses import replace

    from fixtures_daemon import free_port

    ports = [free_port(), free_port()]
    configs = [replace(config(tmp_path / name), node=name, listen=f"127.0.0.1:{ports[i]}",
                       peers=(f"127.0.0.1:{ports[1 - i]}",))
               for i, name in enumerate(("n1", "n2"))]

    async def main() -> dict[str, str]:
        n1, n2 = daemons = [Daemon(c) for c in configs]
        for d in daemons:
            await d.start()
        try:
            await until(lambda: {p.node for p in n1.membership.peers()
                                 if p.state == "up"} == {"n2"}, "n1 to see n2")
            rank_id = await register_self(n2)  # a live rank of n2; n1 coordinates
            await until(lambda: n1.registry.plan is not None, "the plan on n1")
            gen = n1.registry.generation
            kinds = {"exit": common_pb2.FailureEvent.PROCESS_EXIT,
                     "peer lost": common_pb2.FailureEvent.PEER_LOST}
            async with grpc.aio.insecure_channel(n1.address) as ch:
                stub = peer_stub(n1, ch)
                for name, kind in kinds.items():
                    subject = rank_id if name == "exit" else "n2"
                    await stub.ReportFailure(common_pb2.FailureEvent(
                        kind=kind, subject=subject, generation=gen, evidence="forged"),
                        metadata=as_node("n3"), timeout=5)
            await until(lambda: refused(n1, "unconfirmed") >= 2, "both reports to be weighed")
            return {"generation": str(n1.registry.generation),
                    "stopped": str(n1.registry.current_plan().stop)}
        finally:
            for d in daemons:
                await d.stop(grace_s=0)

    assert asyncio.run(main()) == {"generation": "1", "stopped": "False"}


# --- announcements -------------------------------------------------------------------


def test_an_announcement_of_a_ghost_or_another_nodes_rank_is_refused(tmp_path: Path) -> None:
    def announce(node: str, rank_id: str) -> peer_pb2.RankAnnouncement:
        return peer_pb2.RankAnnouncement(node=node, rank_id=rank_id, rank=0, world_size=1,
                                         generation=1)

    async def body(daemon: Daemon) -> tuple[str, str, list[str]]:
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            stub = peer_stub(daemon, ch)
            ghost = await code_of(stub.Announce(announce("ghost", "ghost/7"),
                                                metadata=as_node("ghost"), timeout=5))
            other = await code_of(stub.Announce(announce("n1", "n1/7"),
                                                metadata=as_node("n9"), timeout=5))
        return ghost, other, list(daemon.job.coordinator.announced)

    ghost, other, announced = run(config(tmp_path), body)
    assert ghost.startswith("PERMISSION_DENIED: daemon ghost is not a live member")
    assert other.startswith("PERMISSION_DENIED: daemon n9 announced a rank of node 'n1'")
    assert announced == []


# --- shards --------------------------------------------------------------------------


def test_shards_are_deleted_only_by_owner_or_coordinator_and_never_while_kept(
        tmp_path: Path) -> None:
    async def body(daemon: Daemon) -> dict[str, str]:
        commit_step(daemon.job.snapshots.store, 4)

        def client(node: str) -> ShardClient:
            from stalwart.daemon.security.auth import stamp
            return ShardClient(daemon.address, job_id="default", attempts=1,
                               interceptors=stamp(TOKEN, node))

        owner, stranger, coordinator = client("n2"), client("n9"), client("n1")
        await owner.put("old.0", b"o", step=2)
        await owner.put("kept.0", b"k", step=4)
        out = {}
        for name, c in (("stranger", stranger), ("coordinator, kept step", coordinator),
                        ("owner", owner)):
            try:
                out[name] = str(await c.delete([], below_step=10**11))
            except ShardTransferError as exc:
                out[name] = exc.reason
        out["left"] = str(sorted(p.name for p in (daemon.data_dir / "shards" / "default")
                                 .iterdir() if not p.name.endswith(".json")))
        for c in (owner, stranger, coordinator):
            await c.close()
        return out

    seen = run(config(tmp_path), body)
    assert "PERMISSION_DENIED" in seen["stranger"] and "not by daemon n9" in seen["stranger"]
    assert seen["coordinator, kept step"].startswith("1")  # only the stale step 2 shard
    assert "PERMISSION_DENIED" in seen["owner"] and "step 4 is kept" in seen["owner"]
    assert seen["left"] == "['kept.0']"


def test_peer_shards_count_against_the_disk_quota(tmp_path: Path) -> None:
    cfg = config(tmp_path, snapshot=SnapshotConfig(chunk_bytes=8192,
                                                   disk_quota_bytes=1 << 20))

    async def body(daemon: Daemon) -> str:
        from stalwart.daemon.security.auth import stamp
        c = ShardClient(daemon.address, job_id="default", attempts=1,
                        interceptors=stamp(TOKEN, "n2"))
        try:
            await c.put("big.0", os.urandom(2 << 20), step=1)
        except ShardTransferError as exc:
            return exc.reason
        finally:
            await c.close()
        return "stored"

    outcome = run(cfg, body)
    assert outcome.startswith("RESOURCE_EXHAUSTED") and "disk_quota_bytes" in outcome


@pytest.mark.parametrize("shard_id", ["a" * 201, "dir"])
def test_an_overlong_or_directory_shard_name_is_invalid_not_unknown(
        tmp_path: Path, shard_id: str) -> None:
    async def body(daemon: Daemon) -> list[str]:
        (daemon.data_dir / "shards" / "default" / "dir" / "x").mkdir(parents=True)
        stub = peer_pb2_grpc.ShardServiceStub(daemon.channels.get(daemon.address))
        return [
            await code_of(stub.GetShard(peer_pb2.GetShardRequest(
                job_id="default", shard_id=shard_id), timeout=5).read()),
            await code_of(stub.DeleteShards(peer_pb2.DeleteShardsRequest(
                job_id="default", shard_ids=[shard_id]), timeout=5)),
        ]

    for outcome in run(config(tmp_path), body):
        assert not outcome.startswith(("UNKNOWN", "INTERNAL")), outcome
