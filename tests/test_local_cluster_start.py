"""The local cluster's daemons start on ports of their own, and a port taken from under a
daemon (another process binds it first) makes the cluster start again on new ones instead
of a rank failing later on a daemon that is not there."""

from __future__ import annotations

import socket

import pytest

from stalwart.client import local_cluster
from stalwart.client.local_cluster import ClusterError, LocalCluster
from stalwart.client.ports import free_ports


def test_free_ports_never_gives_a_port_twice_in_a_process() -> None:
    # One call chooses with its sockets held together; later calls skip what was given.
    given = [p for _ in range(20) for p in free_ports(50)]
    assert len(set(given)) == len(given) == 1000


@pytest.mark.multiprocess
def test_a_port_another_process_takes_first_makes_the_daemons_start_on_new_ones(
        tmp_path, monkeypatch) -> None:
    # The fault: something else listens on the port chosen for node-0 before its daemon
    # binds it. Only the choice is steered; the bind fails for real and the cluster must
    # see the daemon exit and start every daemon again on other ports.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    real, calls = local_cluster.free_ports, []

    def steered(n: int) -> list[int]:
        calls.append(n)
        ports = real(n)
        return [taken, *ports[1:]] if len(calls) == 1 else ports

    monkeypatch.setattr(local_cluster, "free_ports", steered)
    cluster = LocalCluster(nodes=2, workdir=tmp_path / "c")
    try:
        cluster.start_daemons()
        assert len(calls) == 2, "the daemons were not started again after the bind failed"
        addresses = {n.address for n in cluster.daemons}
        assert f"127.0.0.1:{taken}" not in addresses and len(addresses) == 2
        for node in cluster.daemons:
            st = node.status()
            assert st is not None and st.node == node.name
    finally:
        cluster.close()
        held.close()


@pytest.mark.multiprocess
def test_a_daemon_that_exits_for_another_reason_is_reported_with_its_log(tmp_path) -> None:
    cluster = LocalCluster(nodes=1, workdir=tmp_path / "c",
                           daemon_settings={"heartbeat_timeout_s": -1.0})
    try:
        with pytest.raises(ClusterError, match=r"node-0 exited with code 2(.|\n)*heartbeat"):
            cluster.start_daemons(attempts=1)
    finally:
        cluster.close()
