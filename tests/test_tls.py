"""Mutual TLS on the daemon's TCP endpoint: only certificates of the cluster CA get in."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from fixtures_hostile import run as run_daemon

from stalwart.daemon.cli import config_from_args, configure
from stalwart.daemon.config import DaemonConfig, TlsConfig
from stalwart.daemon.server import Daemon, DaemonStartError
from stalwart.v1 import operator_pb2, operator_pb2_grpc

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make-certs.sh"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="scripts/make-certs.sh needs the openssl command")


def make_certs(directory: Path, *names: str) -> Path:
    subprocess.run(["bash", str(SCRIPT), str(directory), *names], check=True,
                   capture_output=True, timeout=60)
    return directory


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two independent CAs: the cluster's and a stranger's, each with a daemon and operator."""
    base = tmp_path_factory.mktemp("pki")
    return {"cluster": make_certs(base / "cluster", "node1=127.0.0.1,localhost",
                                  "node2=127.0.0.1", "operator"),
            "other": make_certs(base / "other", "node1=127.0.0.1,localhost", "operator")}


def daemon_config(tmp_path: Path, tls: TlsConfig) -> DaemonConfig:
    return DaemonConfig(node="node1", listen="127.0.0.1:0", metrics_port=0,
                        data_dir=str(tmp_path / "d"), unix_socket=str(tmp_path / "d.sock"),
                        heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, tls=tls)


def tls_of(directory: Path, name: str = "node1") -> TlsConfig:
    return TlsConfig(cert=str(directory / f"{name}.pem"), key=str(directory / f"{name}.key"),
                     ca=str(directory / "ca.pem"))


def credentials(ca: Path, cert_dir: Path | None, name: str = "operator"
                ) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=(cert_dir / f"{name}.key").read_bytes() if cert_dir else None,
        certificate_chain=(cert_dir / f"{name}.pem").read_bytes() if cert_dir else None)


async def status_code(address: str, creds: grpc.ChannelCredentials | None) -> str:
    """"OK" when Status answers, else the gRPC status code name."""
    channel = (grpc.aio.insecure_channel(address) if creds is None
               else grpc.aio.secure_channel(address, creds))
    async with channel:
        try:
            await operator_pb2_grpc.OperatorServiceStub(channel).Status(
                operator_pb2.StatusRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return "OK"




def test_daemon_with_mtls_admits_only_clients_with_a_certificate_of_the_cluster_ca(
        tmp_path: Path, pki: dict[str, Path]) -> None:
    cluster, other = pki["cluster"], pki["other"]

    async def body(daemon: Daemon) -> dict[str, str]:
        a = daemon.address
        return {
            "cluster cert": await status_code(a, credentials(cluster / "ca.pem", cluster)),
            "no cert": await status_code(a, credentials(cluster / "ca.pem", None)),
            "other CA's cert": await status_code(a, credentials(cluster / "ca.pem", other)),
            "plaintext": await status_code(a, None),
        }

    seen = run_daemon(daemon_config(tmp_path, tls_of(cluster)), body)
    assert seen == {"cluster cert": "OK", "no cert": "UNAVAILABLE",
                    "other CA's cert": "UNAVAILABLE", "plaintext": "UNAVAILABLE"}


def test_rotated_certificate_files_are_served_to_new_connections_without_a_restart(
        tmp_path: Path, pki: dict[str, Path]) -> None:
    live = tmp_path / "live"
    shutil.copytree(pki["cluster"], live)
    other = pki["other"]

    async def body(daemon: Daemon) -> tuple[str, str, int]:
        before = await status_code(daemon.address, credentials(live / "ca.pem", live))
        # Rotate to the other CA's files (a new cluster PKI), as an operator would.
        for name in ("node1.pem", "node1.key", "ca.pem"):
            tmp = live / f".{name}.new"
            shutil.copyfile(other / name, tmp)
            os.replace(tmp, live / name)
        after = await status_code(daemon.address, credentials(other / "ca.pem", other))
        assert daemon.tls is not None
        return before, after, daemon.tls.reloads

    before, after, reloads = run_daemon(daemon_config(tmp_path, tls_of(live)), body)
    assert (before, after) == ("OK", "OK")
    assert reloads == 1


def test_daemons_talk_to_each_other_over_mtls(tmp_path: Path, pki: dict[str, Path]) -> None:
    cluster = pki["cluster"]

    async def body(daemon: Daemon) -> str:
        stub = operator_pb2_grpc.OperatorServiceStub(daemon.channels.get(daemon.address))
        reply = await stub.Status(operator_pb2.StatusRequest(), timeout=5.0)
        return reply.node

    assert run_daemon(daemon_config(tmp_path, tls_of(cluster)), body) == "node1"


def test_two_daemons_with_mtls_gossip_and_see_each_other_up(
        tmp_path: Path, pki: dict[str, Path]) -> None:
    from dataclasses import replace

    from fixtures_daemon import free_port

    ports = [free_port(), free_port()]
    configs = [replace(daemon_config(tmp_path / name, tls_of(pki["cluster"], name)), node=name,
                       listen=f"127.0.0.1:{ports[i]}", peers=(f"127.0.0.1:{ports[1 - i]}",))
               for i, name in enumerate(("node1", "node2"))]

    async def main() -> list[list[str]]:
        daemons = [Daemon(c) for c in configs]
        for d in daemons:
            await d.start()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while loop.time() < deadline:
                seen = [[p.node for p in d.membership.peers() if p.state == "up"]
                        for d in daemons]
                if seen == [["node2"], ["node1"]]:
                    break
                await asyncio.sleep(0.05)
            return seen
        finally:
            for d in daemons:
                await d.stop(grace_s=0)

    assert asyncio.run(main()) == [["node2"], ["node1"]]


def test_an_operator_client_reaches_a_tls_daemon_with_the_tls_environment(
        tmp_path: Path, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.client.daemon_client import DaemonClient

    cluster = pki["cluster"]
    monkeypatch.setenv("STALWART_TLS_CERT", str(cluster / "operator.pem"))
    monkeypatch.setenv("STALWART_TLS_KEY", str(cluster / "operator.key"))
    monkeypatch.setenv("STALWART_TLS_CA", str(cluster / "ca.pem"))

    async def body(daemon: Daemon) -> str:
        client = DaemonClient(daemon.address)
        try:
            return (await asyncio.to_thread(client.status)).node
        finally:
            client.close(leaving=False)

    assert run_daemon(daemon_config(tmp_path, tls_of(cluster)), body) == "node1"


def test_a_missing_ca_file_stops_the_start_with_a_message_naming_the_key(
        tmp_path: Path, pki: dict[str, Path]) -> None:
    tls = TlsConfig(cert=str(pki["cluster"] / "node1.pem"),
                    key=str(pki["cluster"] / "node1.key"), ca=str(tmp_path / "nope.pem"))
    with pytest.raises(DaemonStartError, match=r"tls\.ca: cannot read .*nope\.pem"):
        run_daemon(daemon_config(tmp_path, tls), lambda d: asyncio.sleep(0))


def test_tls_flags_set_the_tls_section() -> None:
    import argparse
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--tls-cert", "/c.pem", "--tls-key", "/k.pem",
                              "--tls-ca", "/ca.pem"])
    assert config_from_args(args).tls == TlsConfig("/c.pem", "/k.pem", "/ca.pem")


def test_with_mtls_the_certificate_names_the_calling_daemon(
        tmp_path: Path, pki: dict[str, Path]) -> None:
    from stalwart.v1 import common_pb2, peer_pb2, peer_pb2_grpc

    cluster = pki["cluster"]

    async def call(address: str, name: str, rpc: str, request, metadata=()) -> str:
        async with grpc.aio.secure_channel(address, credentials(cluster / "ca.pem", cluster,
                                                                name)) as ch:
            try:
                await getattr(peer_pb2_grpc.PeerServiceStub(ch), rpc)(
                    request, metadata=metadata, timeout=5.0)
            except grpc.aio.AioRpcError as e:
                return f"{e.code().name}: {e.details()}"
        return "OK"

    async def body(daemon: Daemon) -> dict[str, str]:
        a = daemon.address
        me = peer_pb2.PeerInfo(node="node2", address="127.0.0.1:1")
        return {
            # No token between daemons with TLS: the node certificate is the credential.
            "node2 gossips": await call(a, "node2", "Gossip", me),
            "node2 claims node1": await call(a, "node2", "Gossip", me,
                                             (("stalwart-node", "node1"),)),
            "operator plans": await call(a, "operator", "InstallPlan",
                                         common_pb2.Plan(generation=2)),
            "node2 plans": await call(a, "node2", "InstallPlan", common_pb2.Plan(generation=2)),
        }

    seen = run_daemon(daemon_config(tmp_path, tls_of(cluster)), body)
    assert seen["node2 gossips"] == "OK"
    assert seen["node2 claims node1"].startswith(
        "PERMISSION_DENIED: certificate names node 'node2' but the call claims 'node1'")
    assert seen["operator plans"].startswith("PERMISSION_DENIED: a plan comes only from the "
                                             "coordinator (node1), not from daemon operator")
    # node2 is now a live peer, but "node1" < "node2": node1 coordinates, not node2.
    assert seen["node2 plans"].startswith("PERMISSION_DENIED: a plan comes only from")


def status_cli(address: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`stalwart status --address` as an operator runs it, with only `env`'s TLS settings."""
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_")}
    return subprocess.run([sys.executable, "-m", "stalwart.cli", "status", "--address",
                           address, "--timeout", "5"], capture_output=True, text=True,
                          timeout=60, env={**clean, **env})


def tls_env(directory: Path, name: str = "operator", ca: Path | None = None) -> dict[str, str]:
    return {"STALWART_TLS_CERT": str(directory / f"{name}.pem"),
            "STALWART_TLS_KEY": str(directory / f"{name}.key"),
            "STALWART_TLS_CA": str(ca or directory / "ca.pem")}


def test_status_against_a_tls_daemon_says_what_is_wrong_in_one_line(
        tmp_path: Path, pki: dict[str, Path]) -> None:
    cluster, other = pki["cluster"], pki["other"]

    async def body(daemon: Daemon) -> dict[str, subprocess.CompletedProcess[str]]:
        cases = {"plain": {}, "other CA": tls_env(other),
                 "their cert, our CA": tls_env(other, ca=cluster / "ca.pem"),
                 "CA only": {"STALWART_TLS_CA": str(cluster / "ca.pem")},
                 "wrong key": {**tls_env(cluster),
                               "STALWART_TLS_KEY": str(cluster / "node2.key")},
                 "right": tls_env(cluster)}
        return {name: await asyncio.to_thread(status_cli, daemon.address, env)
                for name, env in cases.items()}

    out = run_daemon(daemon_config(tmp_path, tls_of(cluster)), body)
    assert out["right"].returncode == 0 and out["right"].stdout.startswith("stalwart ")
    expected = {"plain": "this daemon requires TLS", "other CA": "certificate not trusted",
                "their cert, our CA": "certificate not trusted",
                "CA only": "STALWART_TLS_CERT, STALWART_TLS_KEY not set",
                "wrong key": "STALWART_TLS_KEY: key does not match certificate"}
    for name, words in expected.items():
        done = out[name]
        assert done.returncode == 1, (name, done.stdout)
        [line] = done.stderr.strip().splitlines()
        assert line.startswith("stalwart status: ") and words in line, (name, line)
        assert "no daemon answers" not in line


def test_a_key_that_does_not_match_its_certificate_stops_the_start_in_one_line(
        tmp_path: Path, pki: dict[str, Path]) -> None:
    import sys

    cluster = pki["cluster"]
    done = subprocess.run(
        [sys.executable, "-m", "stalwart.cli", "daemon", "--listen", "127.0.0.1:0",
         "--metrics-port", "0", "--data-dir", str(tmp_path / "d"), "--log-format", "text",
         "--tls-cert", str(cluster / "node1.pem"), "--tls-key", str(cluster / "node2.key"),
         "--tls-ca", str(cluster / "ca.pem")],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("STALWART_")})
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "tls.key: key does not match certificate" in lines[0] and "node2.key" in lines[0]
