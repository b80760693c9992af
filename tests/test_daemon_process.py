"""The `stalwart daemon` process: health, reflection, /metrics, gossip and clean shutdown."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import grpc
from fixtures_daemon import DaemonFactory, daemon_env, free_port, health_status, wait_for
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from stalwart.v1 import operator_pb2, operator_pb2_grpc, rank_pb2, rank_pb2_grpc

# Gossip every 0.2 s; a peer silent for 3 s is lost.
FAST = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 3.0}


def test_daemon_serves_health_over_tcp_and_unix_socket(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory.start("a")
    assert health_status(d.address) == "SERVING"
    assert health_status(d.socket_target) == "SERVING"
    endpoint = json.loads((d.data_dir / "daemon.json").read_text())
    assert endpoint["address"] == d.address and endpoint["unix_socket"] == str(d.unix_socket)


def test_reflection_lists_the_stalwart_services(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory.start("a")
    with grpc.insecure_channel(d.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        [reply] = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for s in reply.list_services_response.service}
    assert {"stalwart.v1.RankService", "stalwart.v1.PeerService",
            "stalwart.v1.OperatorService", "stalwart.v1.ShardService",
            "grpc.health.v1.Health"} <= names


def test_logs_are_json_lines_unless_a_terminal_reads_them() -> None:
    code = ("import logging, sys\n"
            "from stalwart.daemon.logs import setup_logging\n"
            "setup_logging('', 'INFO')\n"
            "log = logging.getLogger('stalwart.test')\n"
            "log.info('rank registered', extra={'rank_id': 'a/1'})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30, env=daemon_env())
    [line] = done.stderr.splitlines()
    record = json.loads(line)
    assert (record["level"], record["logger"], record["msg"], record["rank_id"]) == (
        "info", "stalwart.test", "rank registered", "a/1")
    assert record["ts"].endswith("Z")


def test_metrics_endpoint_serves_the_catalogue(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory.start("a")
    text = d.metrics()
    assert "stalwart_generation 1.0" in text
    assert 'stalwart_ranks{state="alive"} 0.0' in text
    assert 'stalwart_failures_detected_total{kind="process_exit"} 0.0' in text
    assert "process_resident_memory_bytes" in text


def test_sigterm_with_a_stream_in_flight_exits_0(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory.start("a")
    started, ended = threading.Event(), threading.Event()

    def watch() -> None:
        with grpc.insecure_channel(d.socket_target) as channel:
            stream = rank_pb2_grpc.RankServiceStub(channel).WatchPlan(
                rank_pb2.WatchPlanRequest(known_generation=1), timeout=30)
            # A later call on the same connection returns after the stream has begun.
            operator_pb2_grpc.OperatorServiceStub(channel).Status(
                operator_pb2.StatusRequest(), timeout=10)
            started.set()
            try:
                for _ in stream:
                    pass
            except grpc.RpcError:
                pass  # cancelled by the server's shutdown: also an end
        ended.set()

    threading.Thread(target=watch, daemon=True).start()
    assert started.wait(10), "the WatchPlan stream did not start"
    assert d.stop(signal.SIGTERM, timeout_s=10) == 0
    assert ended.wait(10), "the WatchPlan stream did not end when the daemon stopped"
    assert not d.unix_socket.exists() and "daemon stopped" in d.log()


def test_sigint_exits_0(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory.start("a")
    assert d.stop(signal.SIGINT, timeout_s=10) == 0


def test_second_daemon_on_the_same_port_fails_naming_listen(
        daemon_factory: DaemonFactory) -> None:
    a = daemon_factory.start("a")
    port = a.address.rpartition(":")[2]
    done = subprocess.run(
        [sys.executable, "-m", "stalwart.cli", "daemon", "--listen", f"127.0.0.1:{port}",
         "--data-dir", str(daemon_factory.base_dir / "b"), "--metrics-port", "0",
         "--log-format", "text"],
        capture_output=True, text=True, timeout=30, env=daemon_env())
    assert done.returncode == 1
    assert f"listen: cannot listen on 127.0.0.1:{port}" in done.stderr


def test_a_data_dir_serves_one_daemon_and_a_refused_one_touches_nothing(
        daemon_factory: DaemonFactory) -> None:
    a = daemon_factory.start("a")
    # A write of a's in flight (same name a crash would leave): the refused one keeps off.
    in_flight = a.data_dir / "snapshots" / "default" / "steps" / "chunk.tmp"
    in_flight.write_bytes(b"half written")
    own = [a.unix_socket, a.data_dir / "fd.sock", a.data_dir / "daemon.json", in_flight]
    assert all(p.exists() for p in own)
    # Another daemon on a's data dir, with a socket and ports of its own: refused.
    done = subprocess.run(
        [sys.executable, "-m", "stalwart.cli", "daemon", "--listen", "127.0.0.1:0",
         "--data-dir", str(a.data_dir), "--metrics-port", "0", "--log-format", "text",
         "--unix-socket", str(daemon_factory.base_dir / "other.sock")],
        capture_output=True, text=True, timeout=30, env=daemon_env())
    assert done.returncode == 1
    [line] = [x for x in done.stderr.splitlines() if "data_dir:" in x]
    assert f"another daemon (pid {a.process.pid}) serves {a.data_dir}" in line
    assert "Traceback" not in done.stderr
    # Another data dir, but a's socket: refused too. Neither touched a's files.
    done = subprocess.run(
        [sys.executable, "-m", "stalwart.cli", "daemon", "--listen", "127.0.0.1:0",
         "--data-dir", str(daemon_factory.base_dir / "b"), "--metrics-port", "0",
         "--log-format", "text", "--unix-socket", str(a.unix_socket)],
        capture_output=True, text=True, timeout=30, env=daemon_env())
    assert done.returncode == 1 and "unix_socket: another daemon is serving" in done.stderr
    assert [p for p in own if not p.exists()] == []
    assert health_status(a.socket_target) == "SERVING"
    # kill -9 frees the lock with the process: a new daemon takes the data dir at once.
    a.stop(signal.SIGKILL)
    again = daemon_factory.start("a")
    assert again.data_dir == a.data_dir and health_status(again.socket_target) == "SERVING"


def test_daemons_find_each_other_and_notice_a_lost_peer(daemon_factory: DaemonFactory) -> None:
    port_a, port_b = free_port(), free_port()
    a = daemon_factory.start("a", port=port_a, peers=(f"127.0.0.1:{port_b}",), settings=FAST)
    b = daemon_factory.start("b", port=port_b, peers=(f"127.0.0.1:{port_a}",), settings=FAST)

    def peer_state(d, node: str) -> str:
        return next((x.state for x in d.status().daemons if x.node == node), "")

    wait_for(lambda: peer_state(a, "b") == "up" and peer_state(b, "a") == "up", 10,
             "both daemons to see each other up")
    assert [x.coordinator for x in a.status().daemons] == [True, False]  # "a" < "b"
    b.stop(signal.SIGKILL)
    wait_for(lambda: peer_state(a, "b") == "lost", 15, "daemon a to mark b lost")
    assert 'stalwart_failures_detected_total{kind="peer_lost"} 0.0' not in a.metrics()
    assert {f.subject for f in a.status().recent_failures} == {"b"}


def test_importing_the_daemon_does_not_import_torch() -> None:
    code = ("import sys, importlib.util\n"
            "import stalwart.daemon.server, stalwart.daemon.cli\n"
            "if importlib.util.find_spec('stalwart.daemon.rpc.shard_service'):\n"
            "    import stalwart.daemon.rpc.shard_service\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=daemon_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
