"""Specification of coordinator election: a real etcd server, real candidate processes."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import aetcd
import pytest
from fixtures_daemon import wait_for
from fixtures_etcd import start_etcd, stop_etcd

from stalwart.client.daemon_client import DaemonClient, DaemonUnavailable
from stalwart.client.ports import free_port
from stalwart.daemon.recovery.election import EtcdElection

TTL_S = 2
TAKEOVER_S = TTL_S + 10.0  # how long a wait may last before the test gives up
WITHIN_LEASE_S = TTL_S + 5.0  # what "within its lease time" allows a loaded machine


class Candidate:
    """An EtcdElection plus an asyncio.Event per transition, for waiting with deadlines."""

    def __init__(self, name: str, endpoint: str, job: str) -> None:
        self.elected, self.lost = asyncio.Event(), asyncio.Event()
        self.reasons: list[str] = []
        self.election = EtcdElection(name, endpoint=endpoint, job_id=job, ttl_s=TTL_S,
                                     on_elected=lambda term: self.elected.set(),
                                     on_lost=self._on_lost)

    def _on_lost(self, reason: str) -> None:
        self.reasons.append(reason)
        self.lost.set()


async def one_elected(a: Candidate, b: Candidate) -> tuple[Candidate, Candidate]:
    done, _ = await asyncio.wait(
        [asyncio.ensure_future(a.elected.wait()), asyncio.ensure_future(b.elected.wait())],
        timeout=TAKEOVER_S, return_when=asyncio.FIRST_COMPLETED)
    assert done, "nobody was elected"
    return (a, b) if a.election.is_leader else (b, a)


def test_of_two_candidates_exactly_one_leads_and_both_agree_who(etcd):
    async def scenario():
        a, b = Candidate("n0", etcd, "agree"), Candidate("n1", etcd, "agree")
        await a.election.start()
        await b.election.start()
        leader, other = await one_elected(a, b)
        names = (await a.election.leader(), await b.election.leader())
        state = (leader.election.is_leader, other.election.is_leader, leader.election.term)
        await a.election.stop()
        await b.election.stop()
        return leader.election.candidate, names, state

    name, names, (lead, other, term) = asyncio.run(scenario())
    assert names == (name, name) and lead and not other and term > 0


def test_a_revoked_leader_lease_hands_the_seat_to_the_other_candidate(etcd):
    async def scenario():
        a, b = Candidate("n0", etcd, "revoke"), Candidate("n1", etcd, "revoke")
        await a.election.start()
        await b.election.start()
        leader, other = await one_elected(a, b)
        first_term = leader.election.term
        host, port = etcd.split(":")
        async with aetcd.Client(host=host, port=int(port)) as admin:
            seat = await admin.get(b"/stalwart/revoke/coordinator")
            await admin.revoke_lease(seat.lease)  # what etcd does when a lease runs out
        await asyncio.wait_for(other.elected.wait(), TAKEOVER_S)
        await asyncio.wait_for(leader.lost.wait(), TAKEOVER_S)
        result = (first_term, other.election.term, leader.reasons,
                  await other.election.leader(), other.election.candidate,
                  leader.election.is_leader)
        await a.election.stop()
        await b.election.stop()
        return result

    first, second, reasons, seat, new_name, deposed_leads = asyncio.run(scenario())
    assert second > first and seat == new_name and not deposed_leads
    assert reasons and "revoked" in reasons[0]


def test_a_resigning_leader_is_replaced_without_waiting_for_its_lease(etcd):
    async def scenario():
        a, b = Candidate("n0", etcd, "resign"), Candidate("n1", etcd, "resign")
        await a.election.start()
        await asyncio.wait_for(a.elected.wait(), TAKEOVER_S)
        await b.election.start()
        await a.election.stop()
        await asyncio.wait_for(b.elected.wait(), TAKEOVER_S)
        leader = await b.election.leader()
        await b.election.stop()
        return a.reasons, leader

    reasons, leader = asyncio.run(scenario())
    assert reasons == ["resigned"] and leader == "n1"


CANDIDATE_PROCESS = """
import asyncio, sys
from stalwart.daemon.recovery.election import EtcdElection

async def main():
    e = EtcdElection("killed-node", endpoint=sys.argv[1], job_id="kill", ttl_s=2,
                     on_elected=lambda term: print("elected", flush=True))
    await e.start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_a_sigkilled_leader_process_is_replaced_within_its_lease_time(etcd):
    async def scenario():
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CANDIDATE_PROCESS, etcd, stdout=asyncio.subprocess.PIPE)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 30.0)
            assert line.strip() == b"elected"
            survivor = Candidate("survivor", etcd, "kill")
            await survivor.election.start()
            assert await survivor.election.leader() == "killed-node"
            # What the dead leader's lease has left (etcd rounds it down to a second):
            # its last refresh may have come late on a loaded machine.
            host, port = etcd.rsplit(":", 1)
            async with aetcd.Client(host, int(port)) as client:
                seat = await client.get(survivor.election.key)
                left = (await client.get_lease_info(seat.lease, keys=False)).TTL
            proc.kill()
            killed_at = time.monotonic()
            await asyncio.wait_for(survivor.elected.wait(), TAKEOVER_S)
            took = time.monotonic() - killed_at
            await survivor.election.stop()
            return took, left
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()

    took, left = asyncio.run(scenario())
    # Not before the dead leader's lease could have run out, and soon after it did.
    assert left <= TTL_S and left - 0.1 <= took < WITHIN_LEASE_S


def test_a_leader_cut_off_from_etcd_steps_down_within_its_lease_time(tmp_path):
    endpoint, proc = start_etcd(tmp_path)

    async def scenario():
        c = Candidate("n0", endpoint, "cut")
        await c.election.start()
        await asyncio.wait_for(c.elected.wait(), TAKEOVER_S)
        proc.send_signal(signal.SIGSTOP)  # etcd freezes: no refresh can land
        frozen_at = time.monotonic()
        await asyncio.wait_for(c.lost.wait(), TAKEOVER_S)
        took = time.monotonic() - frozen_at
        proc.send_signal(signal.SIGCONT)
        await c.election.stop()
        return took, c.reasons[0], c.election.is_leader

    try:
        took, reason, still_leader = asyncio.run(scenario())
    finally:
        stop_etcd(proc)
    assert took < WITHIN_LEASE_S and "could not renew" in reason and not still_leader


def test_daemons_configured_with_etcd_agree_on_the_seat_holder(daemon_factory, etcd):
    a = daemon_factory.start("a", settings={"etcd": etcd, "etcd_lease_s": 2})
    b = daemon_factory.start("b", peers=(a.address,), settings={"etcd": etcd, "etcd_lease_s": 2})

    async def holder() -> str | None:
        host, port = etcd.split(":")
        async with aetcd.Client(host=host, port=int(port)) as admin:
            got = await admin.get(b"/stalwart/default/coordinator")
            return got.value.decode() if got is not None else None

    def views() -> dict[str, set[str]]:
        """Whom each daemon marks as coordinator in its status."""
        return {s.node: {d.node for d in s.daemons if d.coordinator}
                for s in (a.status(), b.status())}

    seat = wait_for(lambda: asyncio.run(holder()), 20, "a daemon to take the etcd seat")
    # The other daemon learns the holder at its next read of the seat (once a heartbeat).
    wait_for(lambda: views() == {"a": {seat}, "b": {seat}}, 20,
             f"both daemons to name {seat} as coordinator")


def test_a_rank_is_told_when_no_coordinator_can_be_elected(daemon_factory):
    closed = f"127.0.0.1:{free_port()}"  # nothing listens: etcd is down
    d = daemon_factory.start("a", settings={"etcd": closed, "etcd_lease_s": 2})
    with DaemonClient(d.socket_target) as client, pytest.raises(DaemonUnavailable) as err:
        client.register(env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert f"no coordinator is elected in etcd at {closed}" in str(err.value)
    assert d.status().node == "a"  # the daemon itself stays up and answers


@pytest.mark.multiprocess
def test_training_rides_out_an_etcd_outage_and_commits_every_step(tmp_path):
    from stalwart.client.local_cluster import LocalCluster

    endpoint, proc = start_etcd(tmp_path)
    steps = 60
    spec = {"model": "tiny", "steps": steps, "faults": [], "collective_timeout_s": 30,
            "model_overrides": {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64,
                                "seq_len": 16},
            "train": {"global_batch": 8, "seed": 0},
            "layout": {"dp": 2, "pp": 1, "tp": 1, "schedule": "1f1b", "microbatches": 1}}
    cluster = LocalCluster(nodes=2, workdir=tmp_path / "cluster",  # logs kept for a failure
                           daemon_settings={"etcd": endpoint, "etcd_lease_s": 2})

    def committed() -> list[int]:
        return [s.latest_committed_step if (s := n.status()) else -1 for n in cluster.daemons]

    try:
        cluster.start_daemons()
        cluster.launch(spec, 2, spares=0, ranks_per_node=1)
        wait_for(lambda: min(committed()) >= 3, 120, "step 3 to commit on both daemons")
        proc.send_signal(signal.SIGSTOP)  # etcd freezes: the seat cannot be renewed
        wait_for(lambda: cluster.coordinator() is None, 30, "the coordinator to step down")
        proc.send_signal(signal.SIGCONT)
        wait_for(lambda: not cluster.running(), 240, "the ranks to finish")
        codes = [r.proc.returncode for r in cluster.ranks]
        losses = [len((r.result() or {}).get("losses", {})) for r in cluster.ranks]
        final = committed()
    finally:
        cluster.close()
        stop_etcd(proc)
    # Each rank exits 0 only once its daemon has committed the last step.
    assert codes == [0, 0] and losses == [steps, steps]
    assert final == [steps, steps]
