"""The demo's recovery summary times each phase from what the processes recorded, not
from when the demo (polling every 0.25 s) happened to look."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

from stalwart.client.demo import _raised, _summarise


def test_detect_plus_plan_ends_when_the_last_role_received_the_plan(tmp_path: Path) -> None:
    fault_t = 1000.0
    (tmp_path / "fault-7.json").write_text(json.dumps(
        {"kind": "kill", "target": "rank", "index": 1, "step": 5, "time_unix": fault_t,
         "pid": 7}))

    def rank(received: float, first: float) -> SimpleNamespace:
        result = {"losses": {str(s): 1.0 for s in range(1, 11)},
                  "result": {"param_digest": "d"},
                  "generations": [{"generation": 2, "plan_received_unix": received,
                                   "first_step_unix": first, "rebuild_s": 0.01,
                                   "restore_s": 0.02}]}
        return SimpleNamespace(result=lambda: result)

    cluster = SimpleNamespace(workdir=tmp_path,
                              ranks=[rank(fault_t + 0.05, fault_t + 0.2),
                                     rank(fault_t + 0.08, fault_t + 0.25)])
    # The demo itself saw the new plan 0.4 s after the fault, at one of its looks.
    plans = [{"generation": 2, "reason": "spare in", "resume_step": 4,
              "time_unix": fault_t + 0.4, "stop": False, "stop_message": ""}]
    summary = _summarise(cluster, argparse.Namespace(steps=10, dp=2, pp=1, tp=1, script=None),
                         [], SimpleNamespace(losses={}), plans, [(fault_t - 1, 4)], [], 5.0,
                         None)
    [recovery] = summary["recoveries"]
    assert recovery["detect_plan_s"] == 0.08
    assert recovery["mttr_s"] == 0.25
    assert recovery["detect_plan_s"] <= recovery["mttr_s"]


def test_faults_that_one_plan_answers_are_one_recovery_naming_them_all(tmp_path: Path) -> None:
    # Ranks 0 and 1 killed at once, both replaced by generation 3; rank 1's spare killed
    # later, replaced by generation 4.
    for pid, index, t, step in ((11, 0, 100.0, 4), (12, 1, 100.01, 4), (13, 1, 105.0, 9)):
        (tmp_path / f"fault-{pid}.json").write_text(json.dumps(
            {"kind": "kill", "target": "rank", "index": index, "step": step, "time_unix": t,
             "pid": pid}))
    result = {"losses": {str(s): 1.0 for s in range(1, 13)}, "result": {"param_digest": "d"},
              "generations": [
                  {"generation": g, "plan_received_unix": t, "first_step_unix": t + 0.1,
                   "rebuild_s": 0.01, "restore_s": 0.02} for g, t in ((3, 100.2), (4, 105.3))]}
    # A role that raised while it rebuilt its groups recorded no phase figures.
    failed = {"generations": [{"generation": 3, "plan_received_unix": 100.1,
                               "first_step_unix": None, "rebuild_s": None,
                               "restore_s": None}], **{k: result[k] for k in ("losses",)}}
    cluster = SimpleNamespace(workdir=tmp_path, ranks=[SimpleNamespace(result=lambda: result),
                                                       SimpleNamespace(result=lambda: failed)])
    # Generation 2 widened the job before any fault: no recovery.
    plans = [{"generation": g, "reason": "spare in", "resume_step": r, "time_unix": t,
              "stop": False, "stop_message": ""}
             for g, r, t in ((2, 1, 50.0), (3, 3, 100.5), (4, 8, 105.5))]
    detected = [{"subject": "node-0/12", "kind": "process_exit", "captured_step": 4}]
    summary = _summarise(cluster, argparse.Namespace(steps=12, dp=2, pp=1, tp=1, script=None),
                         [], SimpleNamespace(losses={}), plans, [(99.0, 3)], detected, 9.0, None)
    assert [(r["kind"], r["fault_step"], r["resume_step"]) for r in summary["recoveries"]] == [
        ("kill rank:0 + kill rank:1", 4, 3), ("kill rank:1", 9, 8)]
    assert summary["recoveries"][0]["captured_step"] == 4
    assert summary["recoveries"][0]["detect_plan_s"] == 0.2
    assert summary["recoveries"][0]["rebuild_s"] == 0.01


def test_a_script_that_trains_its_own_number_of_steps_completes_at_the_jobs_last(
        tmp_path: Path) -> None:
    result = {"losses": {str(s): 1.0 for s in range(1, 9)}, "result": {"param_digest": "d"},
              "generations": []}
    cluster = SimpleNamespace(workdir=tmp_path, ranks=[SimpleNamespace(result=lambda: result)])
    args = argparse.Namespace(steps=10, dp=1, pp=1, tp=1, script=Path("mine.py"))
    summary = _summarise(cluster, args, [], SimpleNamespace(losses={}), [], [], [], 2.0, 8)
    assert summary["completed"] and summary["param_digest"] == "d"
    assert (summary["steps"], summary["asked_steps"]) == (8, 10)
    # Short of the job's own last step, or without the job saying it completed: not done.
    for last in (9, None):
        assert not _summarise(cluster, args, [], SimpleNamespace(losses={}), [], [], [], 2.0,
                              last)["completed"]


def test_a_script_that_reports_no_losses_completes_with_its_digest(tmp_path: Path) -> None:
    result = {"losses": {}, "result": {"steps": 8, "param_digest": "d"}, "generations": []}
    cluster = SimpleNamespace(workdir=tmp_path, ranks=[SimpleNamespace(result=lambda: result)])
    args = argparse.Namespace(steps=10, dp=1, pp=1, tp=1, script=Path("mine.py"))
    summary = _summarise(cluster, args, [], SimpleNamespace(losses={}), [], [], [], 2.0, 8)
    assert summary["completed"] and summary["param_digest"] == "d"
    assert not _summarise(cluster, args, [], SimpleNamespace(losses={}), [], [], [], 2.0,
                          None)["completed"]


def test_a_rank_that_raised_is_summarised_by_its_last_exception(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    log.write_text("[step] 1 loss 0.5\n"
                   "Traceback (most recent call last):\n  File \"a.py\", line 1\n"
                   "KeyError: 'x'\n\nDuring handling of the above exception, another "
                   "exception occurred:\n\nTraceback (most recent call last):\n"
                   "  File \"a.py\", line 3, in <module>\n    main()\n"
                   "ValueError: global batch 8 does not split\n[gloo] teardown\n")
    assert _raised(log) == "ValueError: global batch 8 does not split"
    log.write_text("[step] 1 loss 0.5\nKilled\n")
    assert _raised(log) == "" and _raised(tmp_path / "missing.log") == ""
