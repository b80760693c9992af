"""The commit tree: prepares go up and commits come down a tree of the job's daemons, so
the coordinator talks to `commit_fanout` daemons per step, not to all of them. And gossip
between daemons that know each other carries one entry, not one per daemon.

The shape is pure logic (every daemon derives the same tree); the trust is tested on real
daemons over TCP: a prepare passed up is taken only with its own daemon's tag, a commit
passed on only with the coordinator's signature. tests/test_recovery_e2e.py kills a relay
of both trees mid-run."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import grpc
from fixtures_hostile import as_node, code_of, config, register_self, until
from hypothesis import given
from hypothesis import strategies as st
from snapshot_states import state, tensors

from stalwart.core import step_record as sr
from stalwart.daemon.config_schema import default
from stalwart.daemon.peers import PeerLost
from stalwart.daemon.server import Daemon
from stalwart.daemon.snapshot import commit_tree
from stalwart.daemon.snapshot.prepare_relay import PrepareRelay
from stalwart.v1 import common_pb2, manifest_pb2, peer_pb2, peer_pb2_grpc

LAYOUT = common_pb2.ParallelLayout(dp=1, pp=1, tp=1)


# --- the shape -----------------------------------------------------------------------

@given(st.integers(1, 300), st.integers(1, 40))
def test_every_daemon_is_in_the_tree_once_under_the_parent_that_names_it(n: int,
                                                                        fanout: int) -> None:
    nodes = [f"node-{i:04d}" for i in range(n)]
    seen: list[str] = []
    todo = [None]
    while todo:
        above = todo.pop()
        kids = commit_tree.children(nodes, above, fanout)
        assert len(kids) <= fanout
        for kid in kids:
            assert commit_tree.parent(nodes, kid, fanout) == above
        seen.extend(kids)
        todo.extend(kids)
    assert sorted(seen) == nodes  # reached once each: nobody misses a commit

    def under(node: str) -> int:
        return sum(1 + under(k) for k in commit_tree.children(nodes, node, fanout))

    for node in nodes[:: max(1, n // 17)]:
        assert commit_tree.below(nodes, node, fanout) == under(node)


def test_the_tree_is_a_few_levels_deep_at_thousands_of_daemons() -> None:
    nodes = [f"node-{i:04d}" for i in range(2048)]
    depth = {None: 0}
    todo = [None]
    while todo:
        above = todo.pop()
        for kid in commit_tree.children(nodes, above, default("commit_fanout")):
            depth[kid] = depth[above] + 1
            todo.append(kid)
    assert max(depth.values()) == 3
    assert len(commit_tree.children(nodes, None, 16)) == 16  # what the coordinator sends


def test_a_daemon_outside_the_tree_has_no_place_in_it() -> None:
    nodes = ["a", "b", "c"]
    assert commit_tree.children(nodes, "z", 1) == []
    assert commit_tree.parent(nodes, "z", 1) is None  # it talks to the coordinator
    assert commit_tree.below(nodes, "z", 1) == 0
    assert commit_tree.children(nodes, None, 0) == []  # fanout 0: no tree


def test_the_prepare_tree_is_the_plans_nodes_with_ranks_less_its_coordinator() -> None:
    plan = common_pb2.Plan(coordinator="n0", assignments=[
        common_pb2.RankAssignment(node="n2"), common_pb2.RankAssignment(node="n0"),
        common_pb2.RankAssignment(node="n1"), common_pb2.RankAssignment(node="n1"),
        common_pb2.RankAssignment(node="n3", spare=True)])
    assert commit_tree.prepare_nodes(plan) == ["n1", "n2"]


def test_a_relay_sends_its_subtrees_seals_up_in_one_batch_once_all_are_in() -> None:
    # Fanout 2 over n0..n5 under coordinator c: n0's subtree is n2 and n3. n0 sends one
    # batch to c once its own seal and both of theirs are in, a column per (generation,
    # final), every seal with the tag its own daemon made, in the order they came.
    plan = common_pb2.Plan(generation=1, coordinator="c", commit_fanout=2, assignments=[
        common_pb2.RankAssignment(node=f"n{i}") for i in range(6)])
    keys = commit_tree.RelayKeys()

    def req(node: str, final: bool = False) -> peer_pb2.PrepareStepRequest:
        r = peer_pb2.PrepareStepRequest(job_id="j", step=5, generation=1, node=node,
                                        layout=LAYOUT, final=final)
        r.seal.node, r.seal.digest = node, node.encode().ljust(32, b"-")
        r.seal.ranks.append(int(node[1:]))
        return r

    async def scenario() -> list[tuple[str | None, peer_pb2.PrepareBatch]]:
        sent: list[tuple[str | None, peer_pb2.PrepareBatch]] = []
        gone_up = asyncio.Event()

        async def send(target: str | None, batch: peer_pb2.PrepareBatch) -> None:
            sent.append((target, batch))
            gone_up.set()

        relay = PrepareRelay("n0", "j", lambda: plan, send)
        relay.key = ("c", keys.key_for("n0"))
        assert relay.usable("c")
        relay.own(req("n0"))
        relay.relay([commit_tree.column("j", keys.key_for("n2"), req("n2"))])
        await asyncio.sleep(0)
        assert not sent  # n3 is still to come
        relay.relay([commit_tree.column("j", keys.key_for("n3"), req("n3", final=True))])
        await asyncio.wait_for(gone_up.wait(), 10)
        return sent

    sent = asyncio.run(scenario())
    assert [target for target, _ in sent] == [None]  # n0's parent is the coordinator
    columns = sent[0][1].columns
    assert [(c.final, len(c.seals)) for c in columns] == [(False, 2), (True, 1)]
    for c, nodes in zip(columns, (["n0", "n2"], ["n3"]), strict=True):
        identity = commit_tree.column_identity("j", 5, 1, LAYOUT, c.final)
        assert c.tags == b"".join(commit_tree.tag(keys.key_for(n), identity, seal)
                                  for n, seal in zip(nodes, c.seals, strict=True))
        assert [manifest_pb2.RankSeal.FromString(x).node for x in c.seals] == nodes


def test_prepares_whose_parent_is_declared_lost_go_to_the_coordinator() -> None:
    # n2's parent in the prepare tree is n0; n0 is frozen and, before it answers, declared
    # lost (Links.relay_prepares raises PeerLost): the batch goes to the coordinator.
    plan = common_pb2.Plan(generation=1, coordinator="c", commit_fanout=2, assignments=[
        common_pb2.RankAssignment(node=f"n{i}") for i in range(6)])
    keys = commit_tree.RelayKeys()

    async def scenario() -> list[str | None]:
        tried: list[str | None] = []
        delivered = asyncio.Event()

        async def send(target: str | None, batch: peer_pb2.PrepareBatch) -> None:
            tried.append(target)
            if target == "n0":
                raise PeerLost("daemon n0 was declared lost during the call")
            delivered.set()

        relay = PrepareRelay("n2", "j", lambda: plan, send)
        relay.key = ("c", keys.key_for("n2"))
        r = peer_pb2.PrepareStepRequest(job_id="j", step=5, generation=1, node="n2",
                                        layout=LAYOUT)
        r.seal.node, r.seal.digest = "n2", b"n2".ljust(32, b"-")
        relay.own(r)
        await asyncio.wait_for(delivered.wait(), 10)
        return tried

    assert asyncio.run(scenario()) == ["n0", None]


# --- the trust -----------------------------------------------------------------------

def test_a_tag_binds_a_seal_to_its_daemons_key_and_its_column() -> None:
    keys = commit_tree.RelayKeys()
    req = peer_pb2.PrepareStepRequest(job_id="j", step=4, generation=1, node="n1",
                                      layout=LAYOUT)
    req.seal.node, req.seal.digest = "n1", bytes(32)
    req.seal.ranks.append(0)
    one = commit_tree.column("j", keys.key_for("n1"), req)
    assert len(one.tags) == commit_tree.TAG_BYTES and len(one.seals) == 1

    def identity(step: int = 4, generation: int = 1, final: bool = False, job: str = "j"
                 ) -> bytes:
        return commit_tree.column_identity(job, step, generation, LAYOUT, final)

    assert commit_tree.tag(keys.key_for("n1"), identity(), one.seals[0]) == one.tags
    others = [commit_tree.tag(keys.key_for("n2"), identity(), one.seals[0]),  # another key
              commit_tree.tag(commit_tree.RelayKeys().key_for("n1"), identity(),  # old coordinator
                              one.seals[0])]
    others += [commit_tree.tag(keys.key_for("n1"), i, one.seals[0]) for i in (
        identity(step=5), identity(generation=2), identity(final=True), identity(job="k"))]
    assert one.tags not in others and len(set(others)) == len(others)


def test_a_signature_covers_the_steps_identity_and_digest() -> None:
    key = commit_tree.CommitKey()
    record = sr.build(job_id="j", step=7, generation=2, layout=LAYOUT, base_step=7,
                      seals=[sr.seal("n0", [manifest_pb2.RankState(rank=0, node="n0")])])
    signature = key.sign(record)
    assert commit_tree.signed_by(key.public, record, signature)
    assert not commit_tree.signed_by(commit_tree.CommitKey().public, record, signature)
    later = manifest_pb2.StepRecord()
    later.CopyFrom(record)
    later.step = 8
    assert not commit_tree.signed_by(key.public, later, signature)
    assert not commit_tree.signed_by(key.public, record, b"")


async def three_daemons(root: Path, body):
    """a coordinates (the smallest name); b and c are its peers."""
    a = Daemon(dataclasses.replace(config(root / "a"), node="a"))
    await a.start()
    b = Daemon(dataclasses.replace(config(root / "b"), node="b", peers=(a.address,)))
    c = Daemon(dataclasses.replace(config(root / "c"), node="c", peers=(a.address,)))
    await b.start()
    await c.start()
    try:
        await until(lambda: all({p.node for p in d.membership.peers()} >= {"a", "b", "c"}
                                - {d.config.node} for d in (a, b, c)),
                    "the three daemons to know each other")
        return await body(a, b, c)
    finally:
        for d in (c, b, a):
            await d.stop(grace_s=0)


def prepared(daemon: Daemon, step: int) -> peer_pb2.PrepareStepRequest:
    """A real prepare of rank 0 on `daemon`: its record made durable in its store."""
    store = daemon.job.snapshots.store
    encoded = store.encode(step, 0, state(step), tensors(), coord=common_pb2.RankCoord(rank=0))
    record = store.prepare(step, encoded)
    return peer_pb2.PrepareStepRequest(job_id="default", step=step, node=daemon.config.node,
                                       generation=daemon.registry.generation, layout=LAYOUT,
                                       seal=sr.seal(daemon.config.node, [record]))


def test_a_prepare_passed_up_is_taken_only_with_its_own_daemons_tag(tmp_path: Path) -> None:
    async def body(a: Daemon, b: Daemon, c: Daemon) -> dict[str, object]:
        await register_self(a)  # rank 0 on a: a world of one
        async with grpc.aio.insecure_channel(a.address) as ch:
            stub = peer_pb2_grpc.PeerServiceStub(ch)
            # a's key comes back in the reply to a prepare a sends directly.
            key = (await stub.PrepareStep(prepared(a, 1), metadata=as_node("a"),
                                          timeout=10)).relay_key
            await until(lambda: a.job.snapshots.store.latest_committed() == 1, "step 1")
            two = prepared(a, 2)
            good = commit_tree.column("default", key, two)
            forged = commit_tree.column("default", os.urandom(32), two)
            altered = peer_pb2.SealColumn()
            altered.CopyFrom(good)
            altered.final = True  # the tag was made for a step that is not the last
            batch = peer_pb2.PrepareBatch(job_id="default", columns=[forged, altered])
            out: dict[str, object] = {
                "forged and altered, via b": await code_of(stub.RelayPrepares(
                    batch, metadata=as_node("b"), timeout=10))}
            out["pending after them"] = sorted(a.job.coordinator.commits.steps)
            out["stranger"] = await code_of(stub.RelayPrepares(
                batch, metadata=as_node("z"), timeout=10))
            out["tagged, via b"] = await code_of(stub.RelayPrepares(
                peer_pb2.PrepareBatch(job_id="default", columns=[good]),
                metadata=as_node("b"), timeout=10))
            await until(lambda: a.job.snapshots.store.latest_committed() == 2, "step 2")
        out["key length"] = len(key)
        return out

    seen = asyncio.run(three_daemons(tmp_path, body))
    assert seen["key length"] == 32
    assert seen["forged and altered, via b"] == "OK"  # refused one by one, not the batch
    assert seen["pending after them"] == []
    assert seen["stranger"].startswith("PERMISSION_DENIED: daemon z is not a live member")
    assert seen["tagged, via b"] == "OK"


def test_a_commit_passed_on_is_taken_only_with_the_coordinators_signature(
        tmp_path: Path) -> None:
    async def body(a: Daemon, b: Daemon, c: Daemon) -> dict[str, object]:
        await register_self(a)
        await until(lambda: c.registry.current_plan().commit_key
                    == a.job.coordinator.commits.key.public, "c to hold a's plan and its key")
        one = prepared(a, 1)
        record = sr.build(job_id="default", step=1, generation=one.generation, layout=LAYOUT,
                          seals=[one.seal], base_step=1)
        signed = a.job.coordinator.commits.key.sign(record)

        def request(signature: bytes) -> peer_pb2.CommitStepRequest:
            return peer_pb2.CommitStepRequest(record=record, fanout=2, signature=signature)

        async with grpc.aio.insecure_channel(c.address) as ch:
            stub = peer_pb2_grpc.PeerServiceStub(ch)
            out: dict[str, object] = {
                "unsigned, via b": await code_of(stub.CommitStep(
                    peer_pb2.CommitStepRequest(record=record), metadata=as_node("b"),
                    timeout=10)),
                "signed by another key, via b": await code_of(stub.CommitStep(
                    request(commit_tree.CommitKey().sign(record)), metadata=as_node("b"),
                    timeout=10)),
                "signed, via a stranger": await code_of(stub.CommitStep(
                    request(signed), metadata=as_node("z"), timeout=10))}
            out["committed on c before"] = c.job.snapshots.store.latest_committed()
            out["signed, via b"] = await code_of(stub.CommitStep(
                request(signed), metadata=as_node("b"), timeout=10))
        out["committed on c after"] = c.job.snapshots.store.latest_committed()
        return out

    seen = asyncio.run(three_daemons(tmp_path, body))
    assert seen["unsigned, via b"].startswith(
        "PERMISSION_DENIED: the commit of step 1 comes only from the coordinator")
    assert seen["signed by another key, via b"].startswith(
        "PERMISSION_DENIED: the commit of step 1 comes only from the coordinator")
    assert seen["signed, via a stranger"].startswith(
        "PERMISSION_DENIED: daemon z passed on a commit but is not a live member")
    assert seen["committed on c before"] is None
    assert seen["signed, via b"] == "OK"
    assert seen["committed on c after"] == 1


def test_daemons_that_know_each_other_gossip_one_entry_not_the_whole_job(
        tmp_path: Path) -> None:
    async def body(a: Daemon, b: Daemon, c: Daemon) -> dict[str, list[str]]:
        # Reached, not only heard of: a view changes when a daemon is first reached.
        await until(lambda: a.membership.view() == b.membership.view() and all(
            len(d.membership.peers()) == 2 and all(p.last_seen is not None
                                                   for p in d.membership.peers())
            for d in (a, b)), "a and b to have reached the same daemons")
        async with grpc.aio.insecure_channel(a.address) as ch:
            stub = peer_pb2_grpc.PeerServiceStub(ch)
            as_b = b.peer_info()

            async def ask(view: bytes) -> list[str]:
                as_b.view = view
                reply = await stub.Gossip(as_b, metadata=as_node("b"), timeout=10)
                return [p.node for p in reply.peers]

            return {"same view": await ask(b.membership.view()),
                    "new daemon": await ask(b"")}

    seen = asyncio.run(three_daemons(tmp_path, body))
    assert seen["same view"] == ["a"]
    first, *rest = seen["new daemon"]  # the answering daemon first, then its peers
    assert first == "a" and sorted(rest) == ["b", "c"]
