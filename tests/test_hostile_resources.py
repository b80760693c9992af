"""A hostile caller against the daemon's processes and resources (issue 19): a rank that
registers someone else's pid, slow and silent streams, floods of state, idle fd-socket
connections, another rank's slots, loose file modes and undecodable bytes."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from fixtures_daemon import DaemonFactory
from fixtures_hostile import TOKEN, as_node, code_of, config, run, until
from snapshot_states import commit_step

from stalwart.client.shm import SlotRefused, receive_fd
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.rpc.shard_service import ShardServicer
from stalwart.daemon.server import Daemon
from stalwart.daemon.snapshot.shard_client import ShardClient
from stalwart.daemon.snapshot.slots import FdServer, SlotPool
from stalwart.v1 import (
    common_pb2,
    operator_pb2,
    peer_pb2,
    peer_pb2_grpc,
    rank_pb2,
    rank_pb2_grpc,
)

NOBODY = 65534
is_root = os.geteuid() == 0


# --- pids --------------------------------------------------------------------------------


def test_a_rank_can_register_only_its_own_pid(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory.start("a")
    sleeper = subprocess.Popen(["sleep", "60"], user=NOBODY if is_root else None)
    try:
        with grpc.insecure_channel(d.socket_target) as ch:
            stub = rank_pb2_grpc.RankServiceStub(ch)

            def register(pid: int) -> str:
                try:
                    stub.Register(rank_pb2.RegisterRequest(pid=pid, rank=0, world_size=1),
                                  metadata=d.token_metadata, timeout=10)
                except grpc.RpcError as e:
                    return f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
                return "OK"

            outcomes = {"the daemon": register(d.process.pid), "init": register(1),
                        "another user's process": register(sleeper.pid),
                        "itself": register(os.getpid())}
    finally:
        sleeper.kill()
        sleeper.wait()
    for who in ("the daemon", "init", "another user's process"):
        assert outcomes[who].startswith("PERMISSION_DENIED: pid "), (who, outcomes[who])
    assert outcomes["itself"] == "OK"
    assert d.process.poll() is None  # nothing it was told could make it end itself


CHILD_NAMESPACE_RANK = """
import os, sys, grpc
from stalwart.v1 import rank_pb2, rank_pb2_grpc
with grpc.insecure_channel("unix:" + sys.argv[1]) as ch:
    reply = rank_pb2_grpc.RankServiceStub(ch).Register(rank_pb2.RegisterRequest(
        pid=os.getpid(), rank=0, world_size=1), metadata=(("stalwart-token", sys.argv[2]),),
        timeout=30)
print(os.getpid(), reply.rank_id)
"""


@pytest.mark.skipif(not is_root, reason="a child pid namespace needs root (unshare)")
def test_a_rank_in_a_child_pid_namespace_registers_but_is_never_watched(
        tmp_path: Path) -> None:
    import shutil
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")

    async def body(daemon: Daemon) -> tuple[str, bool]:
        done = await asyncio.to_thread(
            subprocess.run, ["unshare", "--pid", "--fork", sys.executable, "-c",
                             CHILD_NAMESPACE_RANK, str(daemon.unix_socket), TOKEN],
            capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        pid, rank_id = done.stdout.split()
        record = daemon.registry.get(rank_id)
        return pid, record is not None and record.process is None

    inner, unwatched = run(config(tmp_path), body)
    # Its pid is 1 where it runs (the host's init here): taken as a name, never signalled.
    assert (inner, unwatched) == ("1", True)


WAITING_SPARE = """
import sys
from stalwart.client.daemon_client import DaemonClient
client = DaemonClient("unix:" + sys.argv[1], token=sys.argv[2], job_id="")
print(client.register(spare=True, env={"RANK": "-1", "WORLD_SIZE": "1"}).rank_id, flush=True)
sys.stdin.readline()  # registered and alive until the test lets it go
"""


@pytest.mark.skipif(not is_root, reason="a child pid namespace needs root (unshare)")
def test_two_live_ranks_with_one_pid_in_two_pid_namespaces_are_two_ranks(
        tmp_path: Path) -> None:
    import shutil
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")

    async def body(daemon: Daemon) -> list[tuple[str, bool]]:
        procs = []
        try:
            for _ in range(2):  # two pods' processes, each pid 1 where it runs
                procs.append(subprocess.Popen(
                    ["unshare", "--pid", "--fork", sys.executable, "-c", WAITING_SPARE,
                     str(daemon.unix_socket), TOKEN],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
                line = await asyncio.to_thread(procs[-1].stdout.readline)
                assert line, "the process ended before it registered"
            ids = [r.rank_id for r in daemon.registry.ranks()]
            return [(i, not daemon.registry.get(i).ended) for i in sorted(ids)]
        finally:
            for p in procs:
                p.communicate("\n", timeout=60)

    node = config(tmp_path).node
    assert run(config(tmp_path), body) == [(f"{node}/1", True), (f"{node}/1.2", True)]


def test_fencing_never_ends_a_process_that_did_not_register_itself(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])

    async def body(daemon: Daemon) -> tuple[str, str]:
        # Over TCP a pid is taken as a name only: the record is not a process to watch.
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            await rank_pb2_grpc.RankServiceStub(ch).Register(
                rank_pb2.RegisterRequest(pid=sleeper.pid, rank=0, world_size=1),
                metadata=(("stalwart-token", TOKEN),), timeout=10)
            await until(lambda: daemon.registry.plan is not None, "the first plan")
            # The coordinator's next plan leaves that "rank" out: it would be fenced.
            ack = await peer_pb2_grpc.PeerServiceStub(ch).InstallPlan(
                peer_plan(daemon.registry.generation + 1), metadata=as_node("n1"), timeout=5)
        return str(ack.accepted), str(sleeper.poll())

    try:
        accepted, exit_code = run(config(tmp_path), body)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert (accepted, exit_code) == ("True", "None")


def peer_plan(generation: int) -> common_pb2.Plan:
    plan = common_pb2.Plan(generation=generation, reason="the rank is left out")
    plan.assignments.add(rank_id="n1/1", node="n1")
    return plan


# --- slow streams --------------------------------------------------------------------


async def _serve(servicer: ShardServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    peer_pb2_grpc.add_ShardServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_a_trickling_or_stalled_shard_stream_is_cut_off(tmp_path: Path) -> None:
    servicer = ShardServicer(tmp_path / "shards", Metrics(), piece_idle_s=0.5)

    async def main() -> dict[str, str]:
        server, address = await _serve(servicer)
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = peer_pb2_grpc.ShardServiceStub(ch)

                async def empty_pieces():
                    yield peer_pb2.ShardPiece(header=peer_pb2.ShardHeader(
                        job_id="j", shard_id="e.0", size=4))
                    for _ in range(100):  # "still here", forever, without a byte
                        await asyncio.sleep(0.1)
                        yield peer_pb2.ShardPiece()

                async def trickle():
                    yield peer_pb2.ShardPiece(header=peer_pb2.ShardHeader(
                        job_id="j", shard_id="t.0", size=100))
                    for _ in range(100):  # one byte every 0.3 s: never idle 0.5 s
                        await asyncio.sleep(0.3)
                        yield peer_pb2.ShardPiece(data=b"x")

                out = {"empty": await code_of(stub.PutShard(empty_pieces(), timeout=30)),
                       "trickle": await code_of(stub.PutShard(trickle(), timeout=30))}
                client = ShardClient(address, job_id="j")
                await client.put("big.0", os.urandom(24 << 20), step=1)
                await client.close()
                reader = stub.GetShard(peer_pb2.GetShardRequest(job_id="j", shard_id="big.0"))
                await reader.read()  # one piece, then the reader goes quiet
                await until(lambda: not servicer._open, "the silent reader to be cut off")
                reader.cancel()
                return out
        finally:
            await server.stop(0)

    seen = asyncio.run(main())
    assert seen["empty"].startswith("INVALID_ARGUMENT: a ShardPiece after the first must")
    assert seen["trickle"].startswith("DEADLINE_EXCEEDED: no shard piece arrived")


# --- floods of state -----------------------------------------------------------------


def test_gossip_floods_and_impostors_leave_no_state(tmp_path: Path) -> None:
    flood = peer_pb2.PeerInfo(node="n9", address="127.0.0.1:9",
                              rank_ids=["n9/1"] * (1 << 20))  # 5 MiB: within the message cap

    async def body(daemon: Daemon) -> dict[str, str]:
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            stub = peer_pb2_grpc.PeerServiceStub(ch)
            out = {
                "flood": await code_of(stub.Gossip(flood, metadata=as_node("n9"), timeout=30)),
                "impostor": await code_of(stub.Gossip(
                    peer_pb2.PeerInfo(node="n2", address="127.0.0.1:9"),
                    metadata=as_node("n9"), timeout=5)),
                "no token": await code_of(stub.Gossip(
                    peer_pb2.PeerInfo(node="n9", address="127.0.0.1:9"), timeout=5)),
            }
        out["peers"] = str([p.node for p in daemon.membership.peers()])
        return out

    seen = run(config(tmp_path), body)
    assert seen["flood"].startswith("INVALID_ARGUMENT: rank_ids has 1048576 entries, more "
                                    "than the 1024 allowed")
    assert seen["impostor"].startswith("PERMISSION_DENIED: daemon 'n9' gossiped as 'n2'")
    assert seen["no token"].startswith("UNAUTHENTICATED")
    assert seen["peers"] == "[]"


def test_a_gossip_reply_does_not_repeat_other_peers_rank_ids(tmp_path: Path) -> None:
    big = peer_pb2.PeerInfo(node="n9", address="127.0.0.1:9",
                            rank_ids=[f"n9/{i}" for i in range(1024)])

    async def body(daemon: Daemon) -> tuple[int, list[tuple[str, int]]]:
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            stub = peer_pb2_grpc.PeerServiceStub(ch)
            await stub.Gossip(big, metadata=as_node("n9"), timeout=5)
            reply = await stub.Gossip(peer_pb2.PeerInfo(node="n8", address="127.0.0.1:8"),
                                      metadata=as_node("n8"), timeout=5)
        return reply.ByteSize(), [(p.node, len(p.rank_ids)) for p in reply.peers]

    size, peers = run(config(tmp_path), body)
    # Two fake peers of 1M rank ids each used to push every reply past 8 MiB.
    assert ("n9", 0) in peers and size < 1024, (size, peers)


# --- the fd socket ---------------------------------------------------------------------


def test_idle_connections_to_the_fd_socket_do_not_delay_a_slot_hand_out(
        tmp_path: Path) -> None:
    pool = SlotPool(1 << 20, token=TOKEN)
    server = FdServer(pool, tmp_path / "fd.sock")
    server.start()
    idle = []
    try:
        slot = pool.open("n1/1", 4096)[0]
        for _ in range(20):  # connected, silent
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(server.path))
            idle.append(s)
        started = time.monotonic()
        fd, size = receive_fd(server.path, slot.slot_id, TOKEN)
        waited = time.monotonic() - started
        os.close(fd)
    finally:
        for s in idle:
            s.close()
        server.stop()
        pool.close()
    assert size == slot.size
    # Served one at a time with a 5 s read wait, 20 idle callers delayed it by 100 s.
    assert waited < 5.0, f"the slot hand-out waited {waited:.1f} s behind idle connections"


def test_a_slot_is_handed_only_to_the_rank_that_registered_it(tmp_path: Path) -> None:
    pool = SlotPool(1 << 20, token=TOKEN)
    server = FdServer(pool, tmp_path / "fd.sock",
                      owner_check=lambda rank_id, pid: "" if pid == 424242 else
                      f"process {pid} is not that rank")
    server.start()
    try:
        slot = pool.open("n1/424242", 4096)[0]
        with pytest.raises(SlotRefused) as refused:
            receive_fd(server.path, slot.slot_id, TOKEN)
    finally:
        server.stop()
        pool.close()
    assert f"process {os.getpid()} is not that rank" in str(refused.value)


def test_a_rank_that_fetches_its_slot_proves_its_pid_and_is_watched(tmp_path: Path) -> None:
    async def body(daemon: Daemon) -> tuple[bool, bool]:
        token = (("stalwart-token", TOKEN),)
        async with grpc.aio.insecure_channel(daemon.address) as ch:  # TCP: pid unproven
            stub = rank_pb2_grpc.RankServiceStub(ch)
            reply = await stub.Register(rank_pb2.RegisterRequest(
                pid=os.getpid(), rank=0, world_size=1), metadata=token, timeout=10)
            record = daemon.registry.get(reply.rank_id)
            before = record.process is not None
            slot = await stub.OpenSlot(rank_pb2.OpenSlotRequest(
                rank_id=reply.rank_id, nbytes=4096), metadata=token, timeout=10)
        fd, _ = await asyncio.to_thread(receive_fd, slot.fd_socket, slot.slot_id, TOKEN)
        os.close(fd)
        await until(lambda: record.process is not None, "SO_PEERCRED to prove the pid")
        return before, record.process is not None

    assert run(config(tmp_path), body) == (False, True)


def test_without_a_configured_token_the_fd_socket_still_needs_the_job_secret(
        tmp_path: Path) -> None:
    async def body(daemon: Daemon) -> tuple[str, str]:
        secret = (daemon.data_dir / "job.token").read_text().strip()
        slot = daemon.job.snapshots.pool.open("n1/1", 4096)[0]
        try:
            await asyncio.to_thread(receive_fd, daemon.job.snapshots.fd_server.path,
                                    slot.slot_id, "")
        except SlotRefused as exc:
            return secret, str(exc)
        return secret, "handed over"

    cfg = config(tmp_path, token="")
    secret, outcome = run(cfg, body)
    assert len(secret) >= 32
    assert "wrong or missing job token" in outcome
    assert stat.S_IMODE((tmp_path / "job.token").stat().st_mode) == 0o600


# --- files ---------------------------------------------------------------------------


def test_files_and_folders_are_private_whatever_the_umask(
        daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    old = os.umask(0o022)  # the CLI started from a shell with the usual umask
    try:
        d = daemon_factory.start("a")
    finally:
        os.umask(old)

    async def put() -> None:
        from stalwart.daemon.security.auth import stamp
        c = ShardClient(d.address, job_id="default", interceptors=stamp(d.token, "a"))
        await c.put("c1.0", b"shard", step=1)
        await c.close()

    asyncio.run(put())
    shards = d.data_dir / "shards" / "default"
    modes = {p.relative_to(d.data_dir).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in [d.data_dir / "snapshots", d.data_dir / "snapshots" / "default",
                       d.data_dir / "shards", shards, shards / "c1.0",
                       shards / "c1.0.meta.json", d.data_dir / "job.token"]}
    assert {k: v for k, v in modes.items() if v & 0o027} == {}, modes
    assert modes["job.token"] == 0o600

    old = os.umask(0)  # an in-process daemon tightens the umask of its own process
    try:
        async def body(daemon: Daemon) -> dict[str, int]:
            commit_step(daemon.job.snapshots.store, 1)
            root = daemon.job.snapshots.store.root
            return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode)
                    for p in root.rglob("*")}

        local = run(config(tmp_path / "in-process"), body)
    finally:
        os.umask(old)
    assert local and {k: v for k, v in local.items() if v & 0o027} == {}, local


# --- undecodable bytes -------------------------------------------------------------------


def test_undecodable_bytes_are_invalid_argument_on_every_rpc(tmp_path: Path) -> None:
    from stalwart.v1 import rank_pb2 as rank_desc

    services = [rank_desc.DESCRIPTOR.services_by_name["RankService"],
                peer_pb2.DESCRIPTOR.services_by_name["PeerService"],
                peer_pb2.DESCRIPTOR.services_by_name["ShardService"],
                operator_pb2.DESCRIPTOR.services_by_name["OperatorService"]]
    garbage = b"\xff\xff\xff\xff\x0f"

    async def body(daemon: Daemon) -> dict[str, str]:
        out = {}
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            for service in services:
                for m in service.methods:
                    name = f"/{service.full_name}/{m.name}"
                    kind = (("stream_" if m.client_streaming else "unary_")
                            + ("stream" if m.server_streaming else "unary"))
                    call_fn = getattr(ch, kind)(name)
                    if m.client_streaming:
                        async def pieces():
                            yield garbage
                        call = call_fn(pieces(), metadata=as_node("n1"), timeout=5)
                    else:
                        call = call_fn(garbage, metadata=as_node("n1"), timeout=5)
                    out[name] = await code_of(call.read() if m.server_streaming else call)
        return out

    seen = run(config(tmp_path), body)
    assert len(seen) >= 18
    wrong = {k: v for k, v in seen.items() if not v.startswith("INVALID_ARGUMENT")}
    assert wrong == {}
