"""`stalwart demo`: a local cluster trains the GPT example on real text (or any script
written against the public API, --script), failures are injected,
Stalwart detects, re-plans, rebuilds, restores and training continues; a summary
gives each phase's time and the steps lost.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

STOP_WAIT_S = 20.0  # after a stop, the longest wait for the job's processes to end
# @step:S fires once step S is trained; @commit:S once it is also committed everywhere
FAULT = re.compile(r"^(?:(rank|node):(\d+)|(coordinator))@(step|commit):(\d+)$")


def _fault(kind: str):
    def parse(text: str) -> dict[str, Any]:
        m = FAULT.match(text)
        if not m or (m[3] and kind != "kill"):
            raise argparse.ArgumentTypeError(
                f"{text!r}: write rank:R@step:S or node:N@step:S (kill also takes "
                "coordinator@step:S; @commit:S waits for step S to be committed), "
                "e.g. rank:1@step:10")
        # coordinator: resolved to a node once the daemons have chosen their coordinator
        fault = {"kind": kind, "target": m[1] or "coordinator",
                 "index": -1 if m[3] else int(m[2]), "step": int(m[5])}
        if m[4] == "commit":
            fault["committed"] = True
        return fault
    return parse


def configure(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--nodes", type=int, default=2, help="daemons, each standing for one node")
    a("--ranks-per-node", type=int, default=2, help="training ranks per node")
    a("--spares", type=int, default=1,
      help="spare ranks waiting for a role, --tp of them to a node from the last node on")
    a("--dp", type=int, default=2)
    a("--pp", type=int, default=None, help="default: 2 for the GPT example, 1 with --script")
    a("--tp", type=int, default=1)
    a("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    a("--microbatches", type=int, default=None, help="per pipeline round (default: pp)")
    a("--steps", type=int, default=40)
    a("--seed", type=int, default=0)
    a("--model", choices=["tiny", "small", "medium"], default="tiny")
    a("--global-batch", type=int, default=8)
    a("--model-overrides", type=json.loads, default={},
      help='JSON of GPTConfig fields to change, e.g. \'{"d_model": 32, "n_layer": 2}\'')
    a("--kill", type=_fault("kill"), action="append", default=[],
      help="SIGKILL rank R (or node N: its daemon and ranks; or the node whose daemon "
           "coordinates) after step S (@commit:S: once step S is committed); repeatable")
    a("--hang", type=_fault("hang"), action="append", default=[],
      help="make rank R stop answering after step S; repeatable")
    a("--gpu-fault", type=_fault("gpu"), action="append", default=[],
      help="inject an NVML Xid 79 on rank R's device after step S; repeatable")
    a("--error", type=_fault("error"), action="append", default=[],
      help="make rank R's training raise an exception after step S (a bug in the "
           "training code); repeatable")
    a("--no-faults", action="store_true",
      help="inject nothing (default without a fault flag: kill rank 1 at a third of the run)")
    a("--no-shrink", action="store_true",
      help="without a spare, stop at the last committed step instead of shrinking")
    a("--mem-cap", type=int, default=0,
      help="bytes per device a shrunk plan must fit in (0: not checked)")
    a("--collective-timeout", type=float, default=10.0,
      help="seconds a collective may wait before it counts as a hang")
    a("--timeout", type=float, default=900.0, help="seconds for the whole demo")
    a("--commit-fanout", type=int, default=None, metavar="N",
      help="daemons each daemon passes a step's commit on to (the daemons' commit_fanout; "
           "0: the coordinator talks to every daemon directly)")
    a("--etcd", default="", metavar="HOST:PORT",
      help="elect the coordinator through this etcd server (default: smallest node name)")
    a("--workdir", type=Path, default=None, help="keep logs and snapshots here")
    a("--json", dest="json_path", type=Path, default=None, help="write the summary here")
    a("--script", type=Path, default=None,
      help="run this script (written against the public API, e.g. "
           "examples/classifier/train.py) instead of the GPT example: dp x pp x tp ranks, "
           "--steps passed on, the arguments after -- too")
    a("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def _spec(args: argparse.Namespace, faults: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": args.model, "model_overrides": args.model_overrides,
            "train": {"global_batch": args.global_batch, "seed": args.seed},
            "layout": {"dp": args.dp, "pp": args.pp, "tp": args.tp, "schedule": args.schedule,
                       "microbatches": args.microbatches or args.pp},
            "steps": args.steps, "faults": faults,
            # FLOP counts, not times measured at start-up: the same plans on any machine.
            "flops_costs": True,
            "collective_timeout_s": args.collective_timeout}


def _say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:7.2f}s] {text}", flush=True)


def run(args: argparse.Namespace) -> int:
    from stalwart.client.local_cluster import ClusterError, LocalCluster

    if args.pp is None:
        args.pp = 1 if args.script is not None else 2
    world = args.dp * args.pp * args.tp
    if args.nodes * args.ranks_per_node < world:
        print(f"stalwart demo: {args.nodes} nodes x {args.ranks_per_node} ranks hold "
              f"{args.nodes * args.ranks_per_node} ranks, but dp*pp*tp = {world}; raise "
              "--nodes or --ranks-per-node", file=sys.stderr)
        return 2
    per_round = args.dp * (args.microbatches or args.pp)
    if args.script is None and args.global_batch % per_round:
        print(f"stalwart demo: --global-batch {args.global_batch} does not split into dp="
              f"{args.dp} x {args.microbatches or args.pp} micro-batches; choose a multiple "
              f"of {per_round}", file=sys.stderr)
        return 2
    faults = args.kill + args.hang + args.gpu_fault + args.error
    if not faults and not args.no_faults and args.steps >= 2:
        faults = [{"kind": "kill", "target": "rank", "index": min(1, world - 1),
                   "step": min(args.steps - 1, max(2, args.steps // 3))}]
    why = _bad_fault(faults, world, args.nodes, args.steps)
    if why:
        print(f"stalwart demo: {why}", file=sys.stderr)
        return 2
    if args.workdir is not None:
        args.workdir = args.workdir.expanduser().resolve()  # ranks and daemons run elsewhere
    t0 = time.monotonic()
    settings: dict[str, Any] = {
        "elastic": {"shrink": not args.no_shrink, "mem_cap_bytes": args.mem_cap}}
    if args.etcd:
        settings["etcd"] = args.etcd
    if args.commit_fanout is not None:
        settings["commit_fanout"] = args.commit_fanout
    cluster = LocalCluster(nodes=args.nodes, workdir=args.workdir, daemon_settings=settings)
    cluster.env["STALWART_FAULT_LOG"] = str(cluster.workdir)
    what = f"model {args.model}" if args.script is None else f"script {args.script}"
    print(f"Stalwart demo: {args.nodes} nodes, {world} ranks (dp={args.dp} pp={args.pp} "
          f"tp={args.tp}, {args.schedule}), {args.spares} spare(s), {what}, "
          f"{args.steps} steps, snapshot every step")
    for f in faults:
        who = f["target"] if f["index"] < 0 else f"{f['target']} {f['index']}"
        print(f"  will {f['kind']} {who} after step {f['step']}"
              + (" is committed" if f.get("committed") else ""))
    print(f"  logs and snapshots: {cluster.workdir}"
          + ("" if args.workdir is not None else " (removed at exit; --workdir DIR keeps them)"))
    previous = {sig: signal.signal(sig, _interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        cluster.start_daemons()
        coordinator = cluster.coordinator()
        _say(t0, f"{args.nodes} daemons up; coordinator {coordinator.name}"
                 + (f" (elected through etcd at {args.etcd})" if args.etcd else ""))
        victims = cluster.workdir / "coordinator-pids.json"
        for f in faults:
            if f["target"] == "coordinator":
                # Its node may hold only a spare, which runs no step hook: rank 0 fires
                # it, killing the pids the demo lists once every process is started.
                f.update(target="pids", index=coordinator.index, pids_file=str(victims))
                _say(t0, f"  the coordinator fault will kill node {coordinator.index}")
        argv = None
        if args.script is not None:
            script_args = [x for x in args.script_args if x != "--"]
            argv = [str(args.script.resolve()), *script_args, "--steps", str(args.steps)]
            cluster.env["STALWART_FAULTS"] = json.dumps(faults)
        cluster.launch(_spec(args, faults), world, args.spares, args.ranks_per_node,
                       argv=argv, spare_group=args.tp)
        pids = [coordinator.proc.pid, *(r.proc.pid for r in cluster.ranks
                                        if r.node is coordinator)]
        victims.write_text(json.dumps(pids))
        _say(t0, f"{world} ranks and {args.spares} spare(s) launched")
        summary = _watch(cluster, args, t0, faults)
    except ClusterError as exc:
        print(f"stalwart demo: {exc}; logs are in {cluster.workdir}", file=sys.stderr)
        cluster.close(keep_workdir=True)
        return 1
    except _Interrupted as exc:
        print(f"stalwart demo: {exc}: ending the daemons, ranks and spares it started",
              file=sys.stderr)
        cluster.close(keep_workdir=args.workdir is not None)
        return 130
    except BaseException:
        # A fault of the demo itself: end the processes it started, keep their logs.
        cluster.close(keep_workdir=True)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    cluster.close(keep_workdir=args.workdir is not None)
    _print_summary(summary)
    if args.json_path is not None:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"summary written to {args.json_path}")
    return 0 if summary["completed"] else 1


def _bad_fault(faults: list[dict[str, Any]], world: int, nodes: int, steps: int) -> str:
    """Why one of `faults` can never fire in this run, or ""."""
    flag = {"kill": "--kill", "hang": "--hang", "gpu": "--gpu-fault", "error": "--error"}
    for f in faults:
        name = f"{flag[f['kind']]} {f['target']}"
        if f["target"] == "rank" and not 0 <= f["index"] < world:
            return (f"{name}:{f['index']}@step:{f['step']}: the job has ranks 0..{world - 1} "
                    f"(dp*pp*tp = {world}); e.g. rank:{world - 1}@step:{f['step']}")
        if f["target"] == "node" and not 0 <= f["index"] < nodes:
            return (f"{name}:{f['index']}@step:{f['step']}: the demo has nodes 0..{nodes - 1} "
                    f"(--nodes {nodes}); e.g. node:{nodes - 1}@step:{f['step']}")
        if not 1 <= f["step"] < steps:
            return (f"{flag[f['kind']]} ...@step:{f['step']}: a fault fires after a step the "
                    f"run takes and before its last, so 1..{steps - 1} (--steps {steps})")
    return ""


class _Interrupted(Exception):
    pass


def _interrupted(signum: int, _frame: Any) -> None:
    raise _Interrupted(f"stopped by {signal.Signals(signum).name}")


def _watch(cluster: Any, args: argparse.Namespace, t0: float,
           faults: list[dict[str, Any]]) -> dict[str, Any]:
    from stalwart.client.step_log import StepLog
    from stalwart.core.layout import Layout

    follow = StepLog()
    seen_failures: set[tuple[str, int]] = set()
    detected: list[dict[str, Any]] = []  # every failure a daemon reported, in order
    generation, committed, shown_step = 0, 0, 0
    committed_at: list[tuple[float, int]] = []  # (unix time, latest committed step)
    plans: list[dict[str, Any]] = []
    coordinators: list[str] = []  # each daemon that coordinated, in order
    deadline = time.monotonic() + args.timeout
    roles = args.dp * args.pp * args.tp
    stopped_at: float | None = None
    final_layout = Layout(args.dp, args.pp, args.tp)
    completed_step: int | None = None  # the job's last step, once it completed
    while True:
        # Once every rank has ended (or time is up), one last look at the daemons: the
        # ranks of a stopped job leave within a poll interval of the stop.
        last_look = not cluster.running() or time.monotonic() >= deadline
        if not last_look and _finished(cluster, args.steps) >= roles:
            break  # every role is done; what still runs is a rank or spare without one
        if stopped_at is not None and time.monotonic() - stopped_at > STOP_WAIT_S:
            break  # the daemons end what the stop left running; the demo does not wait
        follow.poll([r.log_path for r in cluster.ranks])
        statuses = [n.status() for n in cluster.daemons if n.alive]
        coord = next((s for s in statuses if s is not None and any(
            d.coordinator and d.node == s.node for d in s.daemons)), None)
        for st in statuses:
            for f in st.recent_failures if st else ():
                key = (f.subject, f.kind)
                if key not in seen_failures:
                    seen_failures.add(key)
                    detected.append({"subject": f.subject, "kind": _kind(f.kind),
                                     "by": st.node, "captured_step": f.captured_step,
                                     "evidence": f.evidence})
                    _say(t0, f"DETECTED {_kind(f.kind)} of {f.subject} by {st.node}: "
                             f"{f.evidence}")
        if coord is not None:
            if _note_coordinator(coordinators, coord.node) and len(coordinators) > 1:
                _say(t0, f"COORDINATOR is now {coord.node}")
            if coord.plan.layout.dp and not coord.plan.stop:
                roles = Layout.from_proto(coord.plan.layout).world_size
            if coord.latest_committed_step != committed:
                committed = coord.latest_committed_step
                committed_at.append((time.time(), committed))
            if coord.generation > generation:
                plan = coord.plan
                if generation and plan.completed:
                    _say(t0, f"COMPLETED: {plan.stop_message}")
                    completed_step = plan.resume_step
                elif generation:
                    plans.append({"generation": coord.generation, "reason": plan.reason,
                                  "resume_step": plan.resume_step, "time_unix": time.time(),
                                  "stop": plan.stop, "stop_message": plan.stop_message})
                    if plan.stop:
                        _say(t0, f"STOP at committed step {plan.resume_step}: "
                                 f"{plan.stop_message}")
                        stopped_at = time.monotonic()
                    else:
                        _say(t0, f"NEW PLAN generation {coord.generation}: {plan.reason}; "
                                 f"resume from committed step {plan.resume_step}")
                        final_layout = Layout.from_proto(plan.layout)
                generation = coord.generation
        if follow.losses:
            step = max(follow.losses)
            if step >= shown_step + max(1, args.steps // 10) or step == args.steps > shown_step:
                shown_step = step
                _say(t0, f"step {step:4d}  loss {follow.losses[step]:.4f}  "
                         f"committed {committed}  generation {generation}")
        if last_look:
            break
        time.sleep(0.25)
    follow.poll([r.log_path for r in cluster.ranks])
    if (last := cluster.coordinator()) is not None:  # a hand-over in the last interval
        _note_coordinator(coordinators, last.name)
    _add_missed_plans(cluster, plans)
    summary = _summarise(cluster, args, faults, follow, plans, committed_at, detected,
                         time.monotonic() - t0, completed_step)
    summary["layout"] = {"dp": final_layout.dp, "pp": final_layout.pp, "tp": final_layout.tp}
    summary["coordinators"] = coordinators
    summary["detected"] = detected
    # How each process had ended when training did (None: still running then), before
    # the demo's own clean-up ends the rest: a fenced rank shows -9 here.
    summary["exits"] = {r.log_path.stem: r.proc.poll() for r in cluster.ranks}
    summary["errors"] = {r.log_path.stem: _raised(r.log_path) for r in cluster.ranks
                         if (summary["exits"][r.log_path.stem] or 0) > 0}
    summary["pids"] = {r.log_path.stem: r.proc.pid for r in cluster.ranks}
    summary["logs"] = str(cluster.workdir) if args.workdir is not None else ""
    summary["rank_nodes"] = {r.log_path.stem: r.node.index for r in cluster.ranks}
    return summary


def _raised(log: Path) -> str:
    """The exception a process's log ends its last traceback with, or ""."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    for line in lines[starts[-1] + 1:] if starts else ():
        if line and not line[0].isspace():
            return line  # the first line after the frames: "Type: message"
    return ""


def _add_missed_plans(cluster: Any, plans: list[dict[str, Any]]) -> None:
    """A re-plan the job outran between two looks (it completed soon after) is known
    from the generations its ranks trained in."""
    seen = {p["generation"] for p in plans}
    for r in cluster.ranks:
        for g in (r.result() or {}).get("generations", []):
            if g["generation"] > 1 and g["generation"] not in seen:
                seen.add(g["generation"])
                plans.append({"generation": g["generation"], "reason": g["reason"],
                              "resume_step": g["resume_step"],
                              "time_unix": g["plan_received_unix"], "stop": False,
                              "stop_message": ""})
    plans.sort(key=lambda p: p["generation"])


def _finished(cluster: Any, steps: int) -> int:
    """Rank processes that exited after training every step."""
    done = 0
    for r in cluster.ranks:
        if r.proc.poll() == 0:
            res = r.result() or {}
            done += (str(steps) in res.get("losses", {})
                     or (res.get("result") or {}).get("steps") == steps)
    return done


def _note_coordinator(coordinators: list[str], name: str) -> bool:
    """Append `name` when it differs from the last coordinator seen; True if it did."""
    if coordinators and coordinators[-1] == name:
        return False
    coordinators.append(name)
    return True


def _kind(code: int) -> str:
    from stalwart.v1 import common_pb2

    return common_pb2.FailureEvent.Kind.Name(code).lower()


def _summarise(cluster: Any, args: argparse.Namespace, faults: list[dict[str, Any]],
               follow: Any, plans: list[dict[str, Any]],
               committed_at: list[tuple[float, int]], detected: list[dict[str, Any]],
               elapsed: float, completed_step: int | None) -> dict[str, Any]:
    results = [(r, r.result()) for r in cluster.ranks]
    # Ranks that trained to the end (a script need not report losses).
    finished = [res for _, res in results if res and (res.get("losses") or res.get("result"))]
    # Killed ranks leave no result file, but their printed losses count for their steps.
    losses: dict[int, float] = dict(follow.losses)
    for res in finished:
        losses.update({int(k): v for k, v in res["losses"].items()})
    # Every rank that trained to the end reports the job's digest (all stages and shards).
    digests = {res["result"]["param_digest"] for res in finished if res.get("result")}
    fired = sorted((json.loads(p.read_text()) for p in cluster.workdir.glob("fault-*.json")),
                   key=lambda f: f["time_unix"])
    # A rank's newest step its daemon took a capture of, from its failure (by pid)
    captured = {d["subject"].rpartition("/")[2].partition(".")[0]: d["captured_step"]
                for d in detected
                if d["kind"] != "peer_lost"}
    recoveries = []
    waiting = list(fired)
    for plan in (p for p in plans if not p["stop"]):
        gens = [g for res in finished for g in res.get("generations", [])
                if g["generation"] == plan["generation"]]
        first = max((g["first_step_unix"] or 0 for g in gens), default=0)
        # When the last role received the plan, as the roles recorded it; the demo's own
        # look (every 0.25 s) only when no role's record says.
        received = [g["plan_received_unix"] for g in gens if g.get("plan_received_unix")]
        planned = max(received, default=plan["time_unix"])
        reached = min(received, default=plan["time_unix"])
        # The faults fired before the plan first reached a role: one plan may answer
        # several (two kills at once), the earliest setting the times; a plan after none
        # (a widening once a spare came) is no recovery.
        handled = [f for f in waiting if f["time_unix"] <= reached]
        if not handled:
            continue
        waiting = waiting[len(handled):]
        fault = handled[0]
        before = [c for t, c in committed_at if t <= fault["time_unix"]]
        committed_before = before[-1] if before else 0
        recoveries.append({
            "kind": " + ".join(f"{f['kind']} {f['target']}:{f['index']}" for f in handled),
            "fault_step": fault["step"], "resume_step": plan["resume_step"],
            "lost_steps": max(0, committed_before - plan["resume_step"]),
            "redone_steps": max(0, fault["step"] - plan["resume_step"]),
            "captured_step": next((captured[str(f["pid"])] for f in handled
                                   if str(f["pid"]) in captured), None),
            "detect_plan_s": round(planned - fault["time_unix"], 3),
            # A role that failed in the middle recorded no figure for its phase.
            "rebuild_s": max((g["rebuild_s"] for g in gens if g.get("rebuild_s") is not None),
                             default=None),
            "restore_s": max((g["restore_s"] for g in gens if g.get("restore_s") is not None),
                             default=None),
            # Roles whose state was fetched while their groups were built.
            "restored_ahead": sum(bool(g.get("restored_ahead")) for g in gens),
            "roles": len(gens),
            "mttr_s": round(first - fault["time_unix"], 3) if first else None,
            "reason": plan["reason"]})
    # A script decides its own number of steps (it is passed --steps, and may not read
    # it): the job's own completion says how many it took.
    last = completed_step if args.script is not None and completed_step else args.steps
    # A script that reports no losses has the job's own completion alone to go by.
    completed = (completed_step == last and not losses) or (
        bool(losses) and max(losses) == last and len(losses) == last)
    return {"completed": completed, "elapsed_s": round(elapsed, 2),
            "losses": [losses[s] for s in sorted(losses)],
            "param_digest": digests.pop() if completed and len(digests) == 1 else None,
            "lost_steps": sum(r["lost_steps"] for r in recoveries),
            "recoveries": recoveries,
            "stopped": next((p["stop_message"] for p in plans if p["stop"]), ""),
            "start_layout": {"dp": args.dp, "pp": args.pp, "tp": args.tp},
            "steps": last, "asked_steps": args.steps}


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds} s"


def _print_summary(s: dict[str, Any]) -> None:
    print("\n=== summary ===")
    losses = s["losses"]
    if losses:
        every = max(1, len(losses) // 8)
        shown = sorted({*range(0, len(losses), every), len(losses) - 1})
        print("loss: " + "  ".join(f"{i + 1}:{losses[i]:.3f}" for i in shown))
    for r in s["recoveries"]:
        print(f"recovery from {r['kind']} after step {r['fault_step']}: resumed at committed "
              f"step {r['resume_step']} (lost {r['lost_steps']}, redone {r['redone_steps']}); "
              f"detect+plan {_s(r['detect_plan_s'])}, rebuild {_s(r['rebuild_s'])}, restore "
              f"{_s(r['restore_s'])}, fault to first step {_s(r['mttr_s'])}")
    if s["stopped"]:
        print(f"stopped: {s['stopped']}")
    start, end = s["start_layout"], s["layout"]
    if start != end:
        print(f"layout: dp={start['dp']} pp={start['pp']} tp={start['tp']} -> dp={end['dp']} "
              f"pp={end['pp']} tp={end['tp']}")
    outcome = (f"completed in {s['elapsed_s']} s; param_digest {s['param_digest']}"
               if s["completed"] else f"did NOT complete ({s['elapsed_s']} s)")
    print(f"committed steps lost: {s['lost_steps']}; training {outcome}")
    by_error: dict[str, list[str]] = {}
    for name, error in s.get("errors", {}).items():
        by_error.setdefault(error or "(no traceback in its log)", []).append(name)
    for error, names in by_error.items():
        where = f" (log: {s['logs']}/{sorted(names)[0]}.log)" if s.get("logs") else ""
        print(f"{', '.join(sorted(names))} exited with an error: {error}{where}")
    if s["steps"] != s["asked_steps"]:
        print(f"note: the script trained {s['steps']} steps, not --steps {s['asked_steps']}: "
              "does it read --steps?")
