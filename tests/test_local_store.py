"""The local RAM + disk snapshot store: atomic commit, exact restore, retention (reads,
tiers and corruption: test_chain_reader.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from snapshot_states import commit_step, state, tensors

from stalwart.core.manifest import ManifestError, build_manifest
from stalwart.core.step_record import plan_chain, split
from stalwart.daemon.metrics import Metrics
from stalwart.daemon.snapshot.local_store import LocalStore
from stalwart.daemon.snapshot.predict import predict_param
from stalwart.v1 import common_pb2, manifest_pb2

SMALL = dict(chunk_bytes=8192)


def test_every_committed_step_restores_bitwise(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, base_every=4, retain=20, **SMALL)
    for step in range(1, 8):
        commit_step(store, step, world=2)
    fresh = LocalStore(tmp_path, **SMALL)  # cold RAM: everything comes from disk
    assert fresh.committed_steps() == list(range(1, 8))
    for step in range(1, 8):
        for rank in range(2):
            assert fresh.read_rank(step, rank) == state(step, rank)


def test_deltas_follow_policy_and_store_less_than_bases(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, base_every=3, retain=20, **SMALL)
    codecs = {}
    for step in range(1, 8):
        m = commit_step(store, step)
        codecs[step] = {c.codec for c in m.ranks[0].chunks}
        if step > 1 and manifest_pb2.XOR_DELTA_ZSTD in codecs[step]:
            assert {c.base_step for c in m.ranks[0].chunks} == {step - 1}
    assert [s for s, c in codecs.items() if c == {manifest_pb2.ZSTD}] == [1, 4, 7]


def test_deltas_against_base_apply_to_the_chain_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, base_every=4, retain=20, delta_against="base", **SMALL)
    bases = [{c.base_step for c in commit_step(store, s).ranks[0].chunks} for s in range(1, 7)]
    assert bases == [{1}, {1}, {1}, {1}, {5}, {5}]
    assert LocalStore(tmp_path, **SMALL).read_rank(6, 0) == state(6)


def test_commits_update_the_snapshot_metrics(tmp_path: Path) -> None:
    metrics = Metrics()
    store = LocalStore(tmp_path, metrics=metrics, **SMALL)
    for step in (1, 2):
        commit_step(store, step)
    value = metrics.registry.get_sample_value
    assert value("stalwart_last_committed_step") == 2
    assert value("stalwart_commits_total") == 2
    assert value("stalwart_compression_ratio") > 1.0
    assert value("stalwart_stored_bytes_total", {"tier": "disk"}) > 0


def test_reusing_the_capture_buffer_does_not_disturb_later_deltas(tmp_path: Path) -> None:
    slot = bytearray(state(1))  # one shared-memory slot, overwritten by every capture
    store = LocalStore(tmp_path, retain=20, **SMALL)
    layout = common_pb2.ParallelLayout(dp=1, pp=1, tp=1)
    for step in (1, 2, 3):
        slot[:] = state(step)
        prepared = store.encode(step, 0, slot, tensors())
        assert prepared.root_step == 1
        store.commit(split(build_manifest(job_id="default", step=step, generation=1, layout=layout,
                                    ranks=[store.prepare(step, prepared)],
                                    base_step=prepared.root_step)))
    assert store.load_manifest(3).base_step == 1
    assert [store.read_rank(s, 0) for s in (1, 2, 3)] == [state(s) for s in (1, 2, 3)]


def test_ranks_prepared_from_several_threads_commit_together(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, ram_tier_bytes=60_000, retain=20, **SMALL)
    layout = common_pb2.ParallelLayout(dp=4, pp=1, tp=1)

    def prepare(step: int, rank: int) -> manifest_pb2.RankState:
        coord = common_pb2.RankCoord(rank=rank, dp=rank)
        return store.prepare(step, store.encode(step, rank, state(step, rank), tensors(),
                                                coord=coord))

    with ThreadPoolExecutor(4) as pool:
        for step in (1, 2):
            ranks = list(pool.map(lambda r, s=step: prepare(s, r), range(4)))
            store.commit(split(build_manifest(job_id="default", step=step, generation=1,
                                        layout=layout, ranks=ranks)))
    assert store.ram_used() <= 60_000
    assert [store.read_rank(2, r) for r in range(4)] == [state(2, r) for r in range(4)]


def test_resuming_from_an_older_step_discards_the_newer_ones(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, retain=20, **SMALL)
    for step in range(1, 6):
        commit_step(store, step)
    assert store.discard_after(3) == [4, 5]
    assert store.committed_steps() == [1, 2, 3]
    m = commit_step(store, 4, scale=2)  # the resumed run commits step 4 again
    assert {c.codec for c in m.ranks[0].chunks} == {manifest_pb2.ZSTD}
    fresh = LocalStore(tmp_path, **SMALL)
    assert fresh.read_rank(4, 0) == state(4, scale=2) and fresh.read_rank(3, 0) == state(3)


def test_a_late_encode_of_an_older_plan_never_becomes_the_reference(tmp_path: Path) -> None:
    # Plan 2 resumes from step 1 and redoes step 2 (here with other values); plan 1's
    # encode of step 2, under way when the plan changed, finishes after plan 2's. The
    # next delta must apply to what plan 2 committed, not to plan 1's buffer.
    store = LocalStore(tmp_path, retain=20, **SMALL)
    commit_step(store, 1)
    commit_step(store, 2)
    assert store.discard_after(1, generation=2) == [2]
    redone = store.encode(2, 0, state(7), tensors(), generation=2)
    store.encode(2, 0, state(2), tensors(), generation=1)  # late
    manifest = build_manifest(job_id=store.job_id, step=2, generation=2,
                              layout=common_pb2.ParallelLayout(dp=1, pp=1, tp=1),
                              ranks=[store.prepare(2, redone)])
    store.commit(split(manifest))
    held = store.decoded(2, 0)
    assert held is not None and held.tobytes() == state(7)
    store.encode(3, 0, state(3), tensors(), generation=2)  # a delta on the reference
    assert store.read_rank(2, 0) == state(7)


def test_committed_steps_are_listed_again_after_any_change_to_them(tmp_path: Path) -> None:
    # The listing is kept between changes: this store's own commits and discards show
    # at once; another store's (another process on the same disk) show once the
    # folder's mtime has moved, which the kernel does within a tick of its clock.
    store = LocalStore(tmp_path, **SMALL)
    other = LocalStore(tmp_path, **SMALL)
    for step in range(1, 4):
        commit_step(store, step)
        assert store.committed_steps()[-1] == store.latest_committed() == step
    seen = other.committed_steps()
    folder = other.root / "manifests"
    before = folder.stat()
    assert seen == [1, 2, 3]
    assert store.discard_after(2) == [3] and store.committed_steps() == [1, 2]
    os.utime(folder, ns=(before.st_atime_ns, before.st_mtime_ns + 1))  # the folder moved
    assert other.committed_steps() == [1, 2]


def test_prepared_but_uncommitted_step_is_invisible(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, **SMALL)
    commit_step(store, 1)
    store.prepare(2, store.encode(2, 0, state(2), tensors()))
    assert store.latest_committed() == 1
    with pytest.raises(FileNotFoundError, match="not committed"):
        store.read_rank(2, 0)


def test_commit_refuses_a_step_missing_a_rank(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, **SMALL)
    rank0 = store.prepare(1, store.encode(1, 0, state(1), tensors()))
    manifest = build_manifest(job_id="default", step=1, generation=1,
                              layout=common_pb2.ParallelLayout(dp=2, pp=1, tp=1), ranks=[rank0])
    with pytest.raises(ManifestError, match="missing \\[1\\]"):
        store.commit(split(manifest))
    assert store.latest_committed() is None


def test_commit_refuses_chunks_that_were_never_prepared(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, **SMALL)
    prepared = store.encode(1, 0, state(1), tensors())  # encoded, not made durable
    manifest = build_manifest(job_id="default", step=1, generation=1,
                              layout=common_pb2.ParallelLayout(dp=1, pp=1, tp=1),
                              ranks=[prepared.state])
    with pytest.raises(ValueError, match="not stored"):
        store.commit(split(manifest))


def test_ram_tier_stays_within_its_budget(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, ram_tier_bytes=40_000, retain=20, **SMALL)
    for step in range(1, 6):
        commit_step(store, step)
        assert store.ram_used() <= 40_000
    assert store.read_rank(5, 0) == state(5)


def test_retention_keeps_the_newest_steps_and_their_chains(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, base_every=4, retain=2, **SMALL)
    for step in range(1, 16):
        commit_step(store, step)
    committed = store.committed_steps()
    chains = {s: plan_chain(store.committed_records(), s) for s in (14, 15)}
    # Besides the newest steps' chains, every step within two chain lengths of the newest
    # stays: other daemons' in-flight deltas may still apply to it.
    recent = {c for s in range(15 - 2 * 4, 16) for c in chains.get(s) or plan_chain(
        store.committed_records(), s)}
    assert committed == sorted(set(chains[14]) | set(chains[15]) | recent)
    assert committed[0] > 1 and committed[-2:] == [14, 15]
    assert sorted(int(p.name) for p in (store.root / "steps").iterdir()) == committed
    fresh = LocalStore(tmp_path, **SMALL)
    for step in committed:
        assert fresh.read_rank(step, 0) == state(step)


@settings(max_examples=25, deadline=None)
@given(base_every=st.integers(1, 5), retain=st.integers(1, 4), steps=st.integers(1, 12),
       against=st.sampled_from(["previous", "base"]))
def test_any_policy_keeps_every_retained_step_restorable(base_every: int, retain: int,
                                                         steps: int, against: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp), base_every=base_every, retain=retain,
                           delta_against=against, chunk_bytes=16384)
        for step in range(1, steps + 1):
            commit_step(store, step)
        committed = store.committed_steps()
        assert committed[-min(retain, steps):] == list(range(max(1, steps - retain + 1),
                                                            steps + 1))
        fresh = LocalStore(Path(tmp), chunk_bytes=16384)
        for step in committed:
            assert fresh.read_rank(step, 0) == state(step)


def test_changed_tensor_layout_starts_a_new_base(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, **SMALL)
    commit_step(store, 1)
    m = commit_step(store, 2, scale=2)
    assert {c.codec for c in m.ranks[0].chunks} == {manifest_pb2.ZSTD}
    assert store.read_rank(2, 0) == state(2, scale=2)


def adamw_states(steps: int, n: int = 4096) -> tuple[list, list[bytes], list]:
    """Tensor metas, buffers and hints of a numpy AdamW run (torch's arithmetic in float32)."""
    names = ["w", "w/exp_avg", "w/exp_avg_sq"]
    metas = [common_pb2.TensorMeta(name=name, dtype=common_pb2.FLOAT32, shape=[n],
                                   nbytes=4 * n, offset=4 * n * i) for i, name in enumerate(names)]
    rng = np.random.default_rng(0)
    w, m, v = rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32), \
        np.zeros(n, np.float32)
    buffers, hints = [], []
    for step in range(1, steps + 1):
        hint = manifest_pb2.AdamWHint(param="w", exp_avg="w/exp_avg", exp_avg_sq="w/exp_avg_sq",
                                      lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                      weight_decay=0.1, step=step)
        g = rng.standard_normal(n).astype(np.float32)
        m = m + (g - m) * np.float32(0.1)
        v = v * np.float32(0.999) + (np.float32(0.001) * g) * g
        w = predict_param(w, m, v, hint)
        buffers.append(np.concatenate([w, m, v]).tobytes())
        hints.append([hint])
    return metas, buffers, hints


def test_adamw_hints_shrink_deltas_and_restore_bitwise(tmp_path: Path) -> None:
    metas, buffers, hints = adamw_states(4)
    sizes = {}
    for adamw in (False, True):
        store = LocalStore(tmp_path / str(adamw), retain=20, **SMALL)
        for step, (buf, hint) in enumerate(zip(buffers, hints, strict=True), start=1):
            prepared = store.encode(step, 0, buf, metas, adamw=hint if adamw else ())
            m = build_manifest(job_id="default", step=step, generation=1,
                               layout=common_pb2.ParallelLayout(dp=1, pp=1, tp=1),
                               ranks=[store.prepare(step, prepared)])
            store.commit(split(m))
        sizes[adamw] = sum(c.stored_size for c in m.ranks[0].chunks)
        fresh = LocalStore(tmp_path / str(adamw), **SMALL)
        assert [fresh.read_rank(s, 0) for s in (1, 2, 3, 4)] == buffers
    assert {c.codec for c in m.ranks[0].chunks} == {manifest_pb2.ADAM_PREDICTED_XOR_ZSTD_V2}
    assert list(fresh.load_manifest(4).ranks[0].adamw) == hints[3]
    assert sizes[True] < sizes[False] / 2


def test_adamw_hints_are_used_only_against_the_previous_step(tmp_path: Path) -> None:
    metas, buffers, hints = adamw_states(5)
    store = LocalStore(tmp_path, retain=20, delta_against="base", **SMALL)
    codecs = []
    for step, (buf, hint) in enumerate(zip(buffers, hints, strict=True), start=1):
        prepared = store.encode(step, 0, buf, metas, adamw=hint)
        codecs.append({c.codec for c in prepared.state.chunks})
        store.commit(split(build_manifest(job_id="default", step=step, generation=1,
                                    layout=common_pb2.ParallelLayout(dp=1, pp=1, tp=1),
                                    ranks=[store.prepare(step, prepared)])))
    assert codecs[1] == {manifest_pb2.ADAM_PREDICTED_XOR_ZSTD_V2}  # step 2 against step 1
    assert codecs[2] == {manifest_pb2.XOR_DELTA_ZSTD}  # step 3 against base step 1
    assert [store.read_rank(s, 0) for s in range(1, 6)] == buffers


def test_lossy_mode_is_opt_in_and_restores_its_own_reconstruction(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, lossy=True, retain=20, **SMALL)
    for step in (1, 2, 3):
        m = commit_step(store, step)
    assert manifest_pb2.QUANT_DELTA in {c.codec for c in m.ranks[0].chunks}
    restored = LocalStore(tmp_path, **SMALL).read_rank(3, 0)
    assert len(restored) == len(state(3)) and restored != state(3)
    assert LocalStore(tmp_path, **SMALL).lossy is False


WRITER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from snapshot_states import commit_step
from stalwart.daemon.snapshot.local_store import LocalStore

store = LocalStore(Path({root!r}), chunk_bytes=4096, base_every=5, retain=3)
step = 0
while True:
    step += 1
    print(f"begin {{step}}", flush=True)
    commit_step(store, step, world=2, scale=4)
    print(f"committed {{step}}", flush=True)
"""


@pytest.mark.parametrize("kill_after", ["begin 4", "committed 5", "begin 7"])
def test_sigkill_mid_commit_leaves_the_previous_step_restorable(tmp_path: Path,
                                                                kill_after: str) -> None:
    script = WRITER.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line.strip())
            if seen[-1] == kill_after:
                os.kill(proc.pid, signal.SIGKILL)  # it is already writing the next step
                break
        assert seen and seen[-1] == kill_after, f"writer stopped early: {seen[-3:]}"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    committed = [int(s.split()[1]) for s in seen if s.startswith("committed")]
    store = LocalStore(tmp_path, chunk_bytes=4096)
    latest = store.latest_committed()
    assert latest is not None and latest >= committed[-1]
    for step in store.committed_steps():
        for rank in range(2):
            assert store.read_rank(step, rank) == state(step, rank, scale=4)
    store.sweep_temporaries()  # what the daemon does once it holds the data dir's lock
    assert not list(store.root.rglob("*.tmp"))  # torn writes are swept


def _drift(step: int, rank: int) -> bytes:
    """A state that changes a little each step, so every capture is a small delta."""
    buf = bytearray(state(1, rank))
    for i in range(step):
        buf[(i * 977) % len(buf)] ^= 0xFF
    return bytes(buf)


def test_a_step_that_an_uncommitted_delta_needs_survives_retention(tmp_path: Path) -> None:
    """Captures are pipelined: step 5 is encoded against step 3 while step 4 (encoded
    earlier, against step 2) commits. Retention must not drop step 3 under step 5."""
    store = LocalStore(tmp_path, retain=1, base_every=100, **SMALL)
    layout = common_pb2.ParallelLayout(dp=2, pp=1, tp=1)

    def prepare(step: int) -> list[manifest_pb2.RankState]:
        return [store.prepare(step, store.encode(
            step, r, _drift(step, r), tensors(), coord=common_pb2.RankCoord(rank=r, dp=r)))
            for r in range(2)]

    def commit(step: int, ranks: list[manifest_pb2.RankState]) -> None:
        store.commit(split(build_manifest(job_id="default", step=step, generation=1, layout=layout,
                                    ranks=ranks)))

    for step in (1, 2):
        commit(step, prepare(step))
    third, fourth = prepare(3), prepare(4)  # both deltas against step 2
    commit(3, third)
    fifth = prepare(5)                      # a delta against step 3
    assert {c.base_step for r in fifth for c in r.chunks} == {3}
    commit(4, fourth)                       # retention now looks at step 4's chain only
    commit(5, fifth)
    assert [store.read_rank(5, r) for r in range(2)] == [_drift(5, r) for r in range(2)]


def test_the_daemon_sizes_its_slot_pool_and_ram_tier_from_their_own_keys(
        tmp_path: Path) -> None:
    from stalwart.daemon.config import load_config
    from stalwart.daemon.peers import PeerChannels
    from stalwart.daemon.recovery.registry import Registry
    from stalwart.daemon.snapshot.path import SnapshotPath

    config = load_config(env={"STALWART_SNAPSHOT__SLOT_BYTES": str(64 << 20),
                              "STALWART_SNAPSHOT__RAM_TIER_BYTES": "123456"})
    metrics = Metrics()
    path = SnapshotPath(config, Registry(config.node, 1.0, 5.0, metrics), metrics, tmp_path,
                        lambda: [], PeerChannels(config.tls),
                        send_prepare=None,  # type: ignore[arg-type]
                        is_leader=lambda: True)
    try:
        assert (path.pool.budget_bytes, path.store.ram.budget) == (64 << 20, 123456)
    finally:
        path.pool.close()


def test_a_reader_checking_records_waits_while_a_commit_walks_them(tmp_path: Path) -> None:
    # A commit's garbage collection walks the map of checked records under the store's
    # lock while status and restores read records on other threads; a reader that added
    # to the map meanwhile made a coordinator's commit fail ("dictionary changed size
    # during iteration", seen in a recovery trace).
    store = LocalStore(tmp_path, **SMALL)
    commit_step(store, 1)
    seal = store.load_record(1).seals[0]
    store._checked.clear()  # as after a restart: the next read checks them again
    walking, done = threading.Event(), threading.Event()

    def commit_walking() -> None:
        with store._lock:
            walking.set()
            done.wait(timeout=60)

    walker = threading.Thread(target=commit_walking)
    walker.start()
    assert walking.wait(timeout=60)
    reader = threading.Thread(target=store.records, args=(1, seal))
    reader.start()
    reader.join(timeout=0.5)
    changed_while_walking = bool(store._checked)
    done.set()
    walker.join(timeout=60)
    reader.join(timeout=60)
    assert not changed_while_walking
    assert set(store._checked) == {(1, r) for r in seal.ranks}  # checked, once free
