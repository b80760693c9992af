"""A rank or spare that registers while its job's coordinator is dead stays registered:
its daemon announces it to the next coordinator, which then uses it."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from fixtures_daemon import DaemonFactory, free_port, wait_for

from stalwart.client.daemon_client import DaemonClient

# Gossip every 0.2 s; a silent daemon is lost after 10 s, so the registration below
# surely lands while the dead coordinator is still the one its peers know.
SETTINGS = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 10.0}

RANK = """
import sys
from stalwart.client.daemon_client import DaemonClient
client = DaemonClient(sys.argv[1])
print(client.register(env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}).rank_id,
      flush=True)
client.start_heartbeats()
sys.stdin.read()
"""


def coordinators(d) -> list[str]:
    return [x.node for x in d.status().daemons if x.coordinator]


@pytest.mark.multiprocess
def test_a_spare_registering_while_the_coordinator_is_dead_is_used_by_the_next(
        daemon_factory: DaemonFactory) -> None:
    ports = {n: free_port() for n in "abc"}
    daemons = {n: daemon_factory.start(
        n, port=ports[n], settings=SETTINGS,
        peers=tuple(f"127.0.0.1:{p}" for m, p in ports.items() if m != n)) for n in "abc"}
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    wait_for(lambda: all(coordinators(d) == ["a"] and all(x.state == "up" for x in
                                                         d.status().daemons)
                         for d in daemons.values()), 20, "the three daemons to agree on a")
    rank = subprocess.Popen([sys.executable, "-c", RANK, c.socket_target],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    spare = DaemonClient(b.socket_target)
    try:
        rank_id = rank.stdout.readline().strip()
        wait_for(lambda: any(x.rank_id == rank_id and x.coord.rank == 0
                             for x in b.status().plan.assignments), 20,
                 "the first plan to place the rank")
        a.stop(signal.SIGKILL)  # the fault: the coordinator's daemon dies

        spare_id = spare.register(spare=True).rank_id  # refused before: nobody to tell
        spare.start_heartbeats()
        assert coordinators(b) == ["a"], "the spare registered after b saw a lost"
        wait_for(lambda: coordinators(b) == ["b"], 30, "b to take over from the lost a")

        rank.kill()  # the rank dies: only a spare its daemon kept can take its role
        plan = wait_for(lambda: (p := b.status().plan) and any(
            x.rank_id == spare_id and not x.spare and x.coord.rank == 0
            for x in p.assignments) and p, 30, "the spare to take rank 0's role")
        assert plan.generation >= 2
    finally:
        spare.close()
        if rank.poll() is None:
            rank.kill()
        rank.wait(10)
