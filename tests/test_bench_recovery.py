"""The recovery benchmark's baseline: a torchrun job that loses a rank restarts every rank,
which resume from the last DCP save and train exactly as before the kill."""

from __future__ import annotations

import pytest

from stalwart.bench.recovery import LAYOUT, MODEL, TRAIN, WORLD, _baseline_recovery
from stalwart.bench.recovery_baseline import run_baseline


@pytest.mark.multiprocess
def test_torchrun_restart_resumes_from_last_dcp_save_with_identical_losses(tmp_path):
    kill = {"round": 0, "rank": 1, "step": 3}
    spec = {"model": MODEL, "train": TRAIN, "layout": LAYOUT, "kills": [kill],
            "steps": 4, "ckpt_every": 2}
    events = run_baseline(spec, tmp_path, timeout_s=120)

    restored = {e["rank"]: e["step"] for e in events
                if e["event"] == "restored" and e["round"] == 1}
    assert restored == {r: 2 for r in range(WORLD)}  # every rank restarted, from step 2
    losses = {(e["round"], e["step"]): e["loss"] for e in events
              if e["event"] == "step" and e["rank"] == 0}
    assert losses[(1, 3)] == losses[(0, 3)]  # the redone step is bitwise the same

    rec = _baseline_recovery(events, kill)
    assert rec["lost_steps"] == 1
    phases = sum(rec[k] for k in ("restart_s", "import_s", "rebuild_s", "restore_s",
                                  "first_step_s"))
    assert rec["mttr_s"] == pytest.approx(phases, abs=1e-6)
    assert rec["mttr_s"] > 0


def test_commit_lag_and_survivor_stall_read_the_step_lines_as_the_bench_saw_them(
        tmp_path, monkeypatch):
    from stalwart.bench import recovery
    from stalwart.bench.recovery import _commit_lag, _survivor_stall, _Watch

    monkeypatch.setattr(recovery, "STEADY_FROM", 2)  # the lag of a steady state only

    w = _Watch()
    w.log.seen = {tmp_path / "rank0.log": [(1, 10.0), (2, 10.5), (3, 11.0), (4, 14.0)],
                  tmp_path / "rank1.log": [(1, 10.0), (2, 10.5), (3, 11.0)],  # the victim
                  tmp_path / "spare0.log": [(4, 13.9)]}  # took the victim's place
    w.committed = [(10.6, 1), (11.1, 1), (11.5, 3), (14.5, 3)]
    assert _commit_lag(w, fault_t=12.0) == 1  # lags 1, 2, 0 before the kill
    monkeypatch.setattr(recovery, "STEADY_FROM", 4)
    assert _commit_lag(w, fault_t=12.0) is None  # no look once 4 steps were trained
    assert _survivor_stall(w, tmp_path, victim=1, fault_t=12.0) == 3.0  # rank0: 11 -> 14


@pytest.mark.multiprocess
def test_torchft_beside_us_loses_a_replica_and_its_replacement_heals_and_joins(tmp_path):
    # The peer the benchmark compares against, as a user would run it: a lighthouse, two
    # replica groups, one SIGKILLed after step 3 and a replacement started at once.
    from stalwart.bench.recovery_torchft import run_torchft

    spec = {"model": MODEL, "train": TRAIN, "kill_step": 3}
    out = run_torchft(spec, 1, tmp_path)
    [trial] = out["trials"]
    assert "error" not in trial, trial
    assert trial["healed"]  # it took the survivor's state over TorchFT's own transport
    assert 0 < trial["survivor_stall_s"] < trial["replacement_first_step_s"]
    assert out["replacement_first_step_s"] == trial["replacement_first_step_s"]
