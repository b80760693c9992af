"""Hostile callers: no job token, another user, path traversal, a silent shard stream,
pickle on any boundary. Each test runs a real daemon (in-process or over a socket)."""

from __future__ import annotations

import ast
import asyncio
import errno
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fixtures_hostile import code_of, until
from fixtures_hostile import run as with_daemon

from stalwart.core.step_record import seal
from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.rpc.shard_service import ShardServicer
from stalwart.daemon.security.peercred import PeerCred, refusal
from stalwart.daemon.server import Daemon
from stalwart.daemon.snapshot.slots import FdServer, SlotPool
from stalwart.v1 import manifest_pb2, peer_pb2, peer_pb2_grpc, rank_pb2, rank_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534
TOKEN = "s3cret-job-token"
is_root = os.geteuid() == 0


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may enter (tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="stw-h-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config(data_dir: Path, **kw) -> DaemonConfig:
    return DaemonConfig(node="n1", listen="127.0.0.1:0", metrics_port=0, data_dir=str(data_dir),
                        unix_socket=str(data_dir / "d.sock"), heartbeat_interval_s=0.2,
                        heartbeat_timeout_s=2.0, **kw)




def refused(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("stalwart_auth_refused_total", {"reason": reason}) \
        or 0.0


# --- job token ------------------------------------------------------------------------


def test_a_rank_without_the_job_token_is_refused_on_every_call(open_dir: Path) -> None:
    async def body(daemon: Daemon) -> dict[str, str]:
        async with grpc.aio.insecure_channel(f"unix:{daemon.unix_socket}") as ch:
            stub = rank_pb2_grpc.RankServiceStub(ch)
            good = (("stalwart-token", TOKEN),)
            reg = rank_pb2.RegisterRequest(pid=os.getpid(), rank=0, world_size=1)
            out = {
                "register, no token": await code_of(stub.Register(reg, timeout=5)),
                "register, wrong token": await code_of(stub.Register(
                    rank_pb2.RegisterRequest(pid=os.getpid(), token="guess"), timeout=5)),
                "restore, no token": await code_of(stub.Restore(
                    rank_pb2.RestoreRequest(rank_id="n1/1", step=1), timeout=5).read()),
                "heartbeat, no token": await code_of(stub.Heartbeat(
                    rank_pb2.HeartbeatRequest(rank_id="n1/1"), timeout=5)),
                "register, token": await code_of(stub.Register(reg, metadata=good, timeout=5)),
            }
            out["refusals counted"] = str(refused(daemon.metrics, "token"))
            return out

    seen = with_daemon(config(open_dir, token=TOKEN), body)
    assert seen["register, no token"].startswith("UNAUTHENTICATED: rank pid")
    assert "STALWART_TOKEN" in seen["register, no token"]
    assert seen["register, wrong token"].startswith("UNAUTHENTICATED: rank pid")
    assert seen["restore, no token"].startswith("UNAUTHENTICATED: no job token")
    assert seen["heartbeat, no token"].startswith("UNAUTHENTICATED")
    assert seen["register, token"] == "OK"
    assert seen["refusals counted"] == "4.0"


def test_a_step_message_of_another_job_is_refused(open_dir: Path) -> None:
    async def body(daemon: Daemon) -> str:
        stub = peer_pb2_grpc.PeerServiceStub(daemon.channels.get(daemon.address))
        request = peer_pb2.PrepareStepRequest(
            job_id="other-job", step=3, generation=1, node="n1",
            seal=seal("n1", [manifest_pb2.RankState(rank=0)]))
        return await code_of(stub.PrepareStep(request, timeout=5))

    assert with_daemon(config(open_dir), body).startswith(
        "PERMISSION_DENIED: step message of job 'other-job'")


# --- another uid ----------------------------------------------------------------------

def _try_as_nobody(grpc_socket: str, fd_socket: str) -> str:
    """In a forked child running as nobody: connect to both sockets (plain syscalls only,
    no gRPC in the child) and report what happened, one line each."""
    out = []
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(grpc_socket)
        out.append("grpc socket: connected")
    except OSError as e:
        out.append(f"grpc socket: errno {e.errno}")
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    try:
        sock.connect(fd_socket)
        try:
            sock.sendall(b"anyslot\n")
        except BrokenPipeError:
            pass  # the daemon refused on accept and closed first; its answer is still here
        out.append("fd: " + sock.recv(512).decode().strip())
    except OSError as e:
        out.append(f"fd: errno {e.errno}")
    return "\n".join(out)


def run_as_nobody(grpc_socket: str, fd_socket: str) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop to nobody, try, report, exit without cleanup
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, _try_as_nobody(grpc_socket, fd_socket).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        report = f.read().decode()
    os.waitpid(pid, 0)
    return report


@pytest.mark.skipif(not is_root, reason="switching to the nobody user needs root")
def test_a_rank_of_another_user_cannot_reach_the_daemon(open_dir: Path) -> None:
    def body(daemon: Daemon):
        return asyncio.to_thread(run_as_nobody, str(daemon.unix_socket),
                                 str(daemon.job.snapshots.fd_server.path))

    out = with_daemon(config(open_dir), body)
    # The kernel refuses the connect: both sockets are owner+group only.
    assert out.splitlines() == [f"grpc socket: errno {errno.EACCES}", f"fd: errno {errno.EACCES}"]


@pytest.mark.skipif(not is_root, reason="switching to the nobody user needs root")
def test_the_fd_socket_checks_the_peer_uid_even_when_its_file_mode_is_too_open(
        open_dir: Path) -> None:
    metrics = Metrics()
    pool = SlotPool(1 << 20)
    server = FdServer(pool, open_dir / "fd.sock", metrics=metrics)
    server.start()
    try:
        slot = pool.open("n1/1", 4096)[0]
        server.path.chmod(0o666)  # a mistake in deployment: the uid check still holds
        out = run_as_nobody("/nonexistent", str(server.path))
    finally:
        server.stop()
        pool.close()
    fd_line = out.splitlines()[1]
    assert fd_line.startswith("fd: ERR process ") and f"uid {NOBODY}" in fd_line
    assert "add them to that group" in fd_line
    assert refused(metrics, "uid") == 1.0
    assert slot.slot_id not in fd_line


def test_peer_uid_rule_admits_owner_root_and_group_only() -> None:
    assert refusal(PeerCred(1, 1000, 50), uid=1000, gid=1000) == ""
    assert refusal(PeerCred(1, 0, 0), uid=1000, gid=1000) == ""
    assert refusal(PeerCred(1, 2000, 1000), uid=1000, gid=1000) == ""
    assert "uid 2000" in refusal(PeerCred(0, 2000, 2000), uid=1000, gid=1000)


# --- identifiers ----------------------------------------------------------------------


@pytest.mark.parametrize("shard_id", ["../../etc/passwd", "/etc/passwd", "a/../../b", ".hidden",
                                      "a//b", "x\x00y", "a" * 300])
def test_a_shard_id_that_leaves_the_store_is_refused(open_dir: Path, shard_id: str) -> None:
    async def body(daemon: Daemon) -> list[str]:
        stub = peer_pb2_grpc.ShardServiceStub(daemon.channels.get(daemon.address))
        header = peer_pb2.ShardHeader(job_id="default", shard_id=shard_id, size=1, crc32c=0)

        async def pieces():
            yield peer_pb2.ShardPiece(header=header, data=b"x")

        return [
            await code_of(stub.PutShard(pieces(), timeout=5)),
            await code_of(stub.GetShard(peer_pb2.GetShardRequest(
                job_id="default", shard_id=shard_id), timeout=5).read()),
            await code_of(stub.DeleteShards(peer_pb2.DeleteShardsRequest(
                job_id="default", shard_ids=[shard_id]), timeout=5)),
            await code_of(stub.GetShard(peer_pb2.GetShardRequest(
                job_id="../x", shard_id="ok"), timeout=5).read()),
        ]

    for outcome in with_daemon(config(open_dir), body):
        assert outcome.startswith("INVALID_ARGUMENT: "), outcome
        assert "not allowed" in outcome or "characters" in outcome
    assert not list(Path("/etc").glob("passwd.tmp-*"))


def test_a_record_naming_a_chunk_outside_the_store_is_refused(open_dir: Path) -> None:
    async def body(daemon: Daemon) -> str:
        stub = peer_pb2_grpc.PeerServiceStub(daemon.channels.get(daemon.address))
        records = manifest_pb2.RankRecords(job_id="default", step=1)
        records.ranks.add(rank=0).chunks.add(chunk_id="../../etc/passwd")
        return await code_of(stub.PutRecords(records, timeout=5))

    assert with_daemon(config(open_dir), body).startswith(
        "INVALID_ARGUMENT: rank 0 chunk_id '../../etc/passwd' is not allowed")


# --- slow and greedy peers ------------------------------------------------------------


def test_a_peer_gets_a_bounded_number_of_shard_streams_and_a_silent_one_is_cut_off(
        tmp_path: Path) -> None:
    metrics = Metrics()
    servicer = ShardServicer(tmp_path / "shards", metrics, max_streams_per_peer=2,
                             piece_idle_s=0.5)

    async def main() -> list[str]:
        server = grpc.aio.server()
        peer_pb2_grpc.add_ShardServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        never = asyncio.Event()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = peer_pb2_grpc.ShardServiceStub(ch)

                async def stalled(i: int):
                    header = peer_pb2.ShardHeader(job_id="default", shard_id=f"c{i}.0", size=2)
                    yield peer_pb2.ShardPiece(header=header, data=b"x")
                    await never.wait()  # a slow peer: half a shard, then nothing

                held = [stub.PutShard(stalled(i), timeout=10) for i in range(2)]
                await until(lambda: sum(servicer._open.values()) == 2,
                            "the server to count both streams open")
                third = await code_of(stub.PutShard(stalled(3), timeout=10))
                return [third, *[await code_of(h) for h in held]]
        finally:
            never.set()
            await server.stop(0)

    third, *held = asyncio.run(main())
    assert third.startswith("RESOURCE_EXHAUSTED: ") and "retry" in third
    assert all(h.startswith("DEADLINE_EXCEEDED: no shard piece arrived") for h in held), held
    assert refused(metrics, "peer_limit") == 1.0
    assert servicer._open == {}
    assert not list((tmp_path / "shards").rglob("*.tmp-*"))


# --- a full disk ----------------------------------------------------------------------


def _calls(tree: ast.AST) -> Iterator[tuple[str, ast.Call]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield ast.unparse(node.func), node


def test_no_pickle_crosses_a_process_boundary_or_touches_storage() -> None:
    problems = []
    for folder in ("daemon", "core", "client", "stalwart", "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            where = path.relative_to(REPO)
            imports = {alias.name.split(".")[0] for node in ast.walk(tree)
                       if isinstance(node, ast.Import | ast.ImportFrom)
                       for alias in getattr(node, "names", [])} | {
                (node.module or "").split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom)}
            for banned in ("marshal", "shelve", "dill", "cloudpickle", "joblib"):
                if banned in imports:
                    problems.append(f"{where}: imports {banned}")
            for name, call in _calls(tree):
                if name in ("pickle.loads", "pickle.load", "pickle.Unpickler"):
                    problems.append(f"{where}:{call.lineno}: {name}")
                if name.endswith("torch.load") or name == "load" and "torch" in imports:
                    safe = any(k.arg == "weights_only" and getattr(k.value, "value", None)
                               is True for k in call.keywords)
                    if name.endswith("torch.load") and not safe:
                        problems.append(f"{where}:{call.lineno}: torch.load without "
                                        "weights_only=True")
            if "pickle" in imports and folder in ("daemon", "core"):
                problems.append(f"{where}: the daemon and core never import pickle")
            for node in ast.walk(tree):
                # The one allowed unpickler (DCP import) must restrict the classes it builds.
                if isinstance(node, ast.ClassDef) and any(
                        ast.unparse(b) == "pickle.Unpickler" for b in node.bases):
                    if not any(isinstance(f, ast.FunctionDef) and f.name == "find_class"
                               for f in node.body):
                        problems.append(f"{where}: {node.name} unpickles without find_class")
    assert problems == []
