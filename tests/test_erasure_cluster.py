"""Erasure coding across real daemons: lose m nodes and restore bitwise, lose m + 1 and get
told the newest recoverable step, read around corrupt shards and a frozen peer, repair.

Each test trains a tiny model for a few steps on a LocalCluster (real daemons, a real rank
process on node-0), then reads committed steps back through the Restore RPC of a daemon
that captured nothing, so every byte comes from shards. A frozen peer is simulated with
SIGSTOP (it accepts connections but never answers); tests/test_erasure_netns.py drops a
peer's traffic with iptables where network namespaces are available.
"""

from __future__ import annotations

import itertools
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from stalwart.client.interop import read_from_store
from stalwart.client.local_cluster import LocalCluster, Node, wait_until
from stalwart.core import manifest as mf
from stalwart.core.placement import decodable
from stalwart.daemon.snapshot.checksum import crc32c
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.records import from_disks
from stalwart.daemon.snapshot.shard_reader import placement_of
from stalwart.v1 import manifest_pb2, rank_pb2, rank_pb2_grpc

K, M = 2, 2
STEPS = 7
SPEC = {"model": "tiny",
        "model_overrides": {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "seq_len": 16},
        "train": {"global_batch": 4, "corpus_bytes": 65536, "seed": 0},
        "layout": {"dp": 1, "pp": 1, "tp": 1}, "steps": STEPS, "faults": []}


def restore(node: Node, step: int, rank: int = 0, timeout_s: float = 60.0
            ) -> tuple[int, bytes]:
    """(step restored, state bytes) from `node`'s Restore RPC; step 0 = newest recoverable."""
    token = (node.data_dir / "job.token").read_text().strip()  # RankService needs it
    with grpc.insecure_channel(node.address) as ch:
        pieces = list(rank_pb2_grpc.RankServiceStub(ch).Restore(
            rank_pb2.RestoreRequest(rank_id="test", step=step, rank=rank), timeout=timeout_s,
            metadata=(("stalwart-token", token),)))
    return pieces[0].step, b"".join(p.data for p in pieces[1:])


def manifests(node: Node) -> dict[int, manifest_pb2.Manifest]:
    """The steps `node` committed, whole: each rank's record from whichever daemon of the
    cluster keeps a copy on its disk (their data dirs are siblings)."""
    stores = [LocalStore(d, ram_tier_bytes=0) for d in sorted(node.data_dir.parent.iterdir())
              if (d / "snapshots").is_dir()]
    mine = LocalStore(node.data_dir, ram_tier_bytes=0)
    return {s: mine.load_manifest(s, from_disks(stores)) for s in mine.committed_steps()}


def held(node: Node) -> list[manifest_pb2.Manifest]:
    """The records on `node`'s own disk (its ranks' and the copies it keeps)."""
    store = LocalStore(node.data_dir, ram_tier_bytes=0)
    return [store.held_manifest(s) for s in store.committed_steps()]


def recoverable(found: dict[int, manifest_pb2.Manifest], lost: set[str]) -> list[int]:
    """Steps whose whole chain is decodable from shards with `lost` gone, newest first."""
    return [s for s in sorted(found, reverse=True)
            if all(decodable(placement_of(c), lost) for t in mf.plan_chain(found, s)
                   for r in found[t].ranks for c in r.chunks)]


def scrape(node: Node) -> dict[str, float]:
    """The daemon's Prometheus samples {"name{labels}": value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics",
                                timeout=5) as reply:
        text = reply.read().decode()
    return {name: float(value) for name, _, value in
            (line.rpartition(" ") for line in text.splitlines() if not line.startswith("#"))}


def train(cluster: LocalCluster) -> dict[int, bytes]:
    """Run the rank to the end; the state of every committed step as the rank's own daemon
    (node-0, which holds the chunks in its RAM tier) returns it."""
    cluster.start_daemons()
    cluster.launch(SPEC, world=1)
    wait_until(lambda: all(r.proc.poll() is not None for r in cluster.ranks), 150,
               "the rank to finish training")
    assert cluster.ranks[0].proc.returncode == 0, cluster.ranks[0].log_path.read_text()[-3000:]
    wait_until(lambda: all((st := n.status()) is not None and st.latest_committed_step == STEPS
                           for n in cluster.daemons), 30, "every daemon to commit the last step")
    steps = sorted(manifests(cluster.daemons[-1]))
    assert len(steps) >= 3 and all(len(c.shards) == K + M for m in manifests(
        cluster.daemons[-1]).values() for r in m.ranks for c in r.chunks)
    return {s: restore(cluster.daemons[0], s)[1] for s in steps}


@pytest.fixture
def cluster(tmp_path: Path):
    made: list[LocalCluster] = []

    def make(nodes: int, env: dict[str, str] | None = None, **settings) -> LocalCluster:
        c = LocalCluster(nodes=nodes, workdir=tmp_path / f"c{len(made)}", env=env or {},
                         metrics=True,
                         daemon_settings={"erasure": {"k": K, "m": M},
                                          "snapshot": {"base_every": 3, "retain": 5},
                                          **settings})
        made.append(c)
        return c

    yield make
    for c in made:
        for n in c.daemons:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGCONT)
        c.close()


@pytest.mark.multiprocess
def test_m_lost_restore_bitwise_and_m_plus_one_names_the_newest_recoverable(cluster) -> None:
    # No peer is declared lost during this test: repair must not move shards around.
    c = cluster(6, heartbeat_timeout_s=300.0)
    reference = train(c)
    reader = c.daemons[5]
    found = manifests(reader)
    latest = max(found)
    candidates = [n.name for n in c.daemons[:5]]
    # The rank's record lives on its daemon and m more: losing all of them loses every step.
    copies = {n.name for n in c.daemons
              if LocalStore(n.data_dir, ram_tier_bytes=0).held_record(latest, 0) is not None}
    # Victims (m + 1 of them) that take the newest step while an older one survives.
    victims = next((set(v) for v in itertools.combinations(candidates, M + 1)
                    if not copies <= set(v) and latest not in recoverable(found, set(v))
                    and recoverable(found, set(v))), None)
    assert victims is not None, "no m + 1 daemons whose loss spares an older step"
    by_name = {n.name: n for n in c.daemons}
    first, last = sorted(victims)[:M], sorted(victims)[M]
    for name in first:
        c.kill_daemon(by_name[name])
    for step, want in reference.items():
        assert restore(reader, step) == (step, want), f"step {step} after losing {first}"

    c.kill_daemon(by_name[last])
    # A survivor that never read these steps: `reader` now holds them in its RAM tier.
    reader = next(by_name[n] for n in candidates[1:] if n not in victims)
    newest = recoverable(found, victims)[0]
    with pytest.raises(grpc.RpcError) as err:
        restore(reader, latest)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"newest step still recoverable (from surviving shards) is {newest}" in \
        err.value.details()
    assert ("stalwart-recoverable-step", str(newest)) in err.value.trailing_metadata()
    assert restore(reader, newest) == (newest, reference[newest])
    assert restore(reader, 0) == (newest, reference[newest])


@pytest.mark.multiprocess
def test_the_capturing_daemon_keeps_shards_not_whole_chunks_and_restores_after_a_restart(
        cluster) -> None:
    # [snapshot] local_copy is off by default: node-0 keeps its ranks' chunks as shards
    # (one of each chunk's k + m) and in its RAM tier, not whole on its disk.
    c = cluster(4, heartbeat_timeout_s=300.0)
    reference = train(c)
    node0, node1 = c.daemons[0], c.daemons[1]
    assert not list(node0.data_dir.glob("snapshots/*/steps/*/r0/*.chunk"))
    assert list(node0.data_dir.glob("shards/*/s*-r0-c*.*"))
    # Its memory gone (SIGKILL, started again) and m - 1 other daemons lost: every step
    # is rebuilt bitwise from node-0's own shard and those of the survivors.
    c.kill_daemon(node1)
    c.restart_daemon(node0)
    wait_until(lambda: (st := node0.status()) is not None and
               sum(d.state == "up" for d in st.daemons) >= len(c.daemons) - 2, 60,
               "the restarted daemon to see the survivors")
    for step, want in reference.items():
        assert restore(node0, step) == (step, want), f"step {step} after the restart"
    # Offline, with every daemon stopped: `stalwart export` rebuilds the state from the
    # shards in the data dirs it is given, here all but node-1's.
    for node in c.daemons:
        c.kill_daemon(node)
    survivors = [n.data_dir for n in c.daemons if n is not node1]
    [(record, data)] = read_from_store(survivors, "default", STEPS)
    assert record.rank == 0 and data == reference[STEPS]


@pytest.mark.multiprocess
def test_the_records_outlive_the_daemon_that_captured_them_and_its_first_successor(
        cluster) -> None:
    # Rank 0's record of each step lives on node-0 (its daemon) and the next m daemons
    # on the ring (node-1, node-2). Lose node-0 and node-1: node-4, which never held the
    # record, fetches it from node-2 and rebuilds the chunks from the surviving shards.
    c = cluster(5, heartbeat_timeout_s=300.0)
    reference = train(c)
    by_name = {n.name: n for n in c.daemons}
    holders = [n.name for n in c.daemons
               if LocalStore(n.data_dir, ram_tier_bytes=0).held_record(STEPS, 0) is not None]
    assert holders == ["node-0", "node-1", "node-2"]
    assert LocalStore(by_name["node-4"].data_dir, ram_tier_bytes=0).held_record(STEPS, 0) \
        is None
    for name in ("node-0", "node-1"):
        c.kill_daemon(by_name[name])
    reader = by_name["node-4"]
    for step, want in reference.items():
        assert restore(reader, step) == (step, want), f"step {step} after losing node-0, -1"
    # The third copy gone too: the record is lost, and the error says so.
    c.kill_daemon(by_name["node-2"])
    with pytest.raises(grpc.RpcError) as err:
        restore(reader, STEPS)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no live daemon holds a good copy of the records of ranks [0]" in \
        err.value.details()


def first_reads(manifest: manifest_pb2.Manifest, reader: Node) -> list[manifest_pb2.ShardRecord]:
    """Per chunk, the shard `reader` asks for first: the lowest index held by a peer
    (ShardReader reads its own memory first, then peers' data shards before parity)."""
    return [min((rec for rec in chunk.shards if rec.node != reader.name),
                key=lambda rec: rec.index)
            for r in manifest.ranks for chunk in r.chunks]


def read_errors(node: Node) -> float:
    """Shard reads this daemon found wrong or could not finish (its metrics)."""
    return sum(v for k, v in scrape(node).items()
               if k.startswith(("stalwart_scrub_errors_total", "stalwart_peer_errors_total")))


@pytest.mark.multiprocess
def test_corrupt_shard_and_frozen_peer_are_read_around(cluster) -> None:
    c = cluster(4, heartbeat_timeout_s=300.0)
    reference = train(c)
    # The newest step comes decoded from the daemon that captured it (node-0, GetHeld)
    # while it holds it; the one before is read from shards, as every step is once
    # that daemon is gone.
    latest, target = sorted(reference)[-1], sorted(reference)[-2]
    found = manifests(c.daemons[3])
    # Corrupt, for every chunk of both steps, the shard the reader asks for first.
    reader = c.daemons[3]
    victims = first_reads(found[target], reader)
    by_name = {n.name: n for n in c.daemons}
    for rec in [*victims, *first_reads(found[latest], reader)]:
        path = by_name[rec.node].data_dir / "shards" / "default" / rec.location
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    before = read_errors(reader)
    assert restore(reader, latest) == (latest, reference[latest])
    assert read_errors(reader) == before  # held by node-0: no shard was read
    assert restore(reader, target) == (target, reference[target])
    assert read_errors(reader) >= before + len(victims)  # each was read, refused, read around

    # A frozen peer accepts connections and never answers: the read hedges to others. The
    # reader has restored nothing yet (no cached chunk), and the frozen daemon holds the
    # first shard it asks for.
    reader = c.daemons[1]
    frozen = by_name[first_reads(found[target], reader)[0].node]
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert restore(reader, target, timeout_s=60.0) == (target, reference[target])
        assert time.monotonic() - t0 >= 2.0  # it waited on the frozen holder, then hedged
    finally:
        frozen.proc.send_signal(signal.SIGCONT)

    # The capturing daemon frozen (not yet declared lost): node-3, which keeps no copy of
    # the rank's records, asks the next holder once node-0 is silent for a second; node-0's
    # held copy of the newest step never comes, and the step's chain is read from the
    # other daemons' shards instead. Each silent call waits its hedge or idle bound, far
    # under the 30 s one record fetch may take.
    capturer, reader = by_name["node-0"], by_name["node-3"]
    assert LocalStore(reader.data_dir, ram_tier_bytes=0).held_record(latest, 0) is None
    capturer.proc.send_signal(signal.SIGSTOP)
    try:
        assert restore(reader, latest, timeout_s=20.0) == (latest, reference[latest])
    finally:
        capturer.proc.send_signal(signal.SIGCONT)
    assert "held state not fetched" in reader.log_path.read_text()


@pytest.mark.multiprocess
def test_lost_daemon_is_repaired_so_m_more_losses_are_survived(cluster) -> None:
    c = cluster(5, env={"STALWART_SCRUB_INTERVAL_S": "1"})
    reference = train(c)
    reader = c.daemons[4]
    lost = c.daemons[3]
    # A scrub pass finds a corrupt shard on disk and re-creates it in place.
    shard_dir = c.daemons[2].data_dir / "shards" / "default"
    newest = manifests(reader)[max(reference)]
    victim = next(shard_dir / rec.location for r in newest.ranks for ch in r.chunks
                  for rec in ch.shards if rec.node == c.daemons[2].name)
    good = victim.read_bytes()
    victim.write_bytes(bytes(b ^ 0xFF for b in good[:16]) + good[16:])
    wait_until(lambda: victim.exists() and crc32c(victim.read_bytes()) == crc32c(good), 30,
               "scrub to re-create the corrupt shard")

    c.kill_daemon(lost)

    def repaired() -> bool:
        return all(rec.node != lost.name for n in c.daemons if n.alive
                   for m in held(n) for r in m.ranks for ch in r.chunks for rec in ch.shards)

    wait_until(repaired, 60, "the repair leader to re-create the lost daemon's shards")
    assert all(len({rec.node for rec in ch.shards}) == K + M
               for m in manifests(reader).values() for r in m.ranks for ch in r.chunks)
    leader = scrape(c.daemons[0])  # the live daemon with the smallest name drives repair
    assert leader["stalwart_repaired_shards_total"] > 0
    assert leader["stalwart_repair_pending_shards"] == 0
    assert leader['stalwart_shards{state="repairing"}'] == 0
    # m-tolerance is back: m more daemons may go and every step still restores bitwise.
    for n in c.daemons[1:3]:
        c.kill_daemon(n)
    for step, want in reference.items():
        assert restore(reader, step) == (step, want), f"step {step} after repair and 2 losses"


@pytest.mark.multiprocess
def test_a_dead_peer_not_yet_declared_lost_does_not_cost_a_step(cluster) -> None:
    # node-4 dies before training and, with a 300 s timeout, is never declared lost while
    # the job runs: placement keeps choosing it, and its shards must go elsewhere.
    c = cluster(5, heartbeat_timeout_s=300.0)
    c.start_daemons()
    dead = c.daemons[4]
    c.kill_daemon(dead)
    c.launch(SPEC, world=1)
    wait_until(lambda: all(r.proc.poll() is not None for r in c.ranks), 150,
               "the rank to finish training")
    assert c.ranks[0].proc.returncode == 0, c.ranks[0].log_path.read_text()[-3000:]
    survivors = c.daemons[:4]
    wait_until(lambda: all((st := n.status()) is not None and st.latest_committed_step == STEPS
                           for n in survivors), 30, "every survivor to commit the last step")
    found = manifests(survivors[-1])
    holders = {s.node for m in found.values() for r in m.ranks for c_ in r.chunks
               for s in c_.shards}
    assert dead.name not in holders and len(holders) >= K + M
    assert "shard rerouted" in c.daemons[0].log_path.read_text()
    # Four live daemons for k + m = 4 shards: full tolerance is kept, every step survives
    # the loss of any m more daemons besides the dead one.
    for more in itertools.combinations([n.name for n in survivors], M):
        assert recoverable(found, {dead.name, *more}) == sorted(found, reverse=True), more
    latest = max(found)
    assert restore(survivors[-1], latest)[1] == restore(c.daemons[0], latest)[1]
