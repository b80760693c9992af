"""`stalwart status`: the daemons, ranks and last heartbeats of a job, as a table or JSON.

Asks one daemon (the local Unix socket by default), then each peer that daemon
sees alive, so the table covers the ranks of every node it can reach.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from stalwart.daemon.config_schema import SOCKET_LOOKUP, daemon_socket


def configure(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--address", metavar="HOST:PORT", help="a daemon's TCP endpoint")
    where.add_argument("--socket", metavar="PATH",
                       help=f"a daemon's Unix socket (default: {SOCKET_LOOKUP})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--local", action="store_true",
                        help="show only the asked daemon's ranks; do not ask its peers")
    parser.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS",
                        help="how long to wait for each daemon (default 3)")


def _target(args: argparse.Namespace) -> str:
    if args.address:
        return args.address
    if args.socket:
        return f"unix:{args.socket}"
    return f"unix:{daemon_socket()}"


def _ask(target: str, timeout_s: float) -> Any:
    import grpc

    from stalwart.client.daemon_env import tls_credentials
    from stalwart.v1 import operator_pb2, operator_pb2_grpc

    creds = None if target.startswith("unix:") else tls_credentials()
    channel = (grpc.secure_channel(target, creds) if creds is not None
               else grpc.insecure_channel(target))
    with channel:
        stub = operator_pb2_grpc.OperatorServiceStub(channel)
        return stub.Status(operator_pb2.StatusRequest(), timeout=timeout_s)


def gather(target: str, timeout_s: float, local: bool) -> dict[str, Any]:
    """Status of the daemon at `target` (and of its live peers unless `local`), as plain data."""
    import grpc

    first = _ask(target, timeout_s)
    replies, unreachable = [first], []
    if not local:
        for d in first.daemons[1:]:
            if d.state not in ("up", "suspect"):
                continue
            try:
                replies.append(_ask(d.address, timeout_s))
            except grpc.RpcError as e:
                unreachable.append(f"{d.node or d.address}: {e.code().name}")  # type: ignore[attr-defined]
    ranks = {r.rank_id: r for reply in replies for r in reply.ranks}
    failures = {(f.time_unix_ms, f.subject, f.kind): f
                for reply in replies for f in reply.recent_failures}
    from stalwart.v1 import common_pb2

    newest = max(replies, key=lambda r: r.plan.generation)
    plan = newest.plan
    # The plan says who holds which role: a spare that took one is a rank now.
    roles = {a.rank_id: a for a in plan.assignments}
    coordinator = next((r for r in replies if r.plan_changes), first)
    return {
        "node": first.node,
        "version": first.version,
        "generation": max(r.generation for r in replies),
        "plan": _plan_view(plan),
        "committed_step": max(r.latest_committed_step for r in replies),
        "storage": dict(first.storage),
        "plan_changes": [{"time_unix_ms": c.time_unix_ms, "reason": c.reason}
                         for c in coordinator.plan_changes],
        "daemons": [
            {"node": d.node, "address": d.address, "state": d.state,
             "last_seen_age_s": None if d.last_seen_age_s < 0 or i == 0 else d.last_seen_age_s,
             "coordinator": d.coordinator,
             "ranks": sum(1 for r in ranks.values() if r.node == d.node)}
            for i, d in enumerate(first.daemons)],
        "ranks": sorted(
            (_rank_view(r, roles.get(r.rank_id), bool(roles))
             for r in ranks.values()),
            key=lambda v: (v["rank"] is None, v["rank"] or 0, v["rank_id"])),
        "failures": [
            {"time_unix_ms": f.time_unix_ms,
             "kind": common_pb2.FailureEvent.Kind.Name(f.kind).lower(),
             "subject": f.subject, "evidence": f.evidence, "reporter": f.reporter}
            for f in sorted(failures.values(), key=lambda f: f.time_unix_ms)],
        "unreachable": unreachable,
    }


def _plan_view(plan: Any) -> dict[str, Any] | None:
    if not plan.generation:
        return None
    lay = plan.layout
    return {"generation": plan.generation, "dp": lay.dp, "pp": lay.pp, "tp": lay.tp,
            "resume_step": plan.resume_step, "reason": plan.reason, "stop": plan.stop,
            "completed": plan.completed, "stop_message": plan.stop_message,
            "coordinator": plan.coordinator,
            "spares": sum(1 for a in plan.assignments if a.spare)}


def _rank_view(r: Any, role: Any, planned: bool) -> dict[str, Any]:
    """One rank's row: its role from the plan (when there is one), its last step only
    while it lives (a dead rank's step is history, kept as last_step)."""
    if planned:
        holds = role is not None and not role.spare
        rank = role.coord.rank if holds else None
        coord = ({"dp": role.coord.dp, "pp": role.coord.pp, "tp": role.coord.tp}
                 if holds else None)
    else:
        rank, coord = (None if r.spare else r.rank), None
    dead = r.state == "dead"
    return {"rank_id": r.rank_id, "node": r.node, "pid": r.pid, "rank": rank, "coord": coord,
            "state": r.state, "step": None if dead else r.step, "last_step": r.step,
            "step_time_s": None if dead else r.step_time_s,
            "last_heartbeat_age_s": r.last_heartbeat_age_s}


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s ago"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in (header, *rows)]


def render(view: dict[str, Any]) -> str:
    """The status as the table `stalwart status` prints."""
    daemons, ranks = view["daemons"], view["ranks"]
    lines = [f"stalwart {view['version']} - asked {view['node']} - generation "
             f"{view['generation']} - {len(daemons)} daemons, {len(ranks)} ranks"]
    plan = view["plan"]
    if plan is None:
        lines.append("plan: none yet (waiting for every rank of the job to register)")
    elif plan["completed"]:
        lines.append(f"plan: completed - {plan['stop_message']}")
    elif plan["stop"]:
        lines.append(f"plan: STOPPED at committed step {plan['resume_step']} - "
                     f"{plan['stop_message']}")
    else:
        lines.append(f"plan: generation {plan['generation']}, dp={plan['dp']} pp={plan['pp']} "
                     f"tp={plan['tp']}, {plan['spares']} spare(s), resumed from step "
                     f"{plan['resume_step']} ({plan['reason']})")
    lines.append(f"committed step: {view['committed_step'] or 'none yet'}")
    for tier, summary in sorted(view["storage"].items()):
        lines.append(f"{tier}: {summary}")
    lines.append("")
    lines += _table(
        ["DAEMON", "ADDRESS", "STATE", "LAST SEEN", "RANKS", "ROLE"],
        [[d["node"] or "?", d["address"], d["state"], _age(d["last_seen_age_s"]),
          str(d["ranks"]), "coordinator" if d["coordinator"] else ""] for d in daemons])
    lines.append("")
    if ranks:
        lines += _table(
            ["RANK", "RANK ID", "NODE", "PID", "STATE", "STEP", "STEP TIME", "LAST HEARTBEAT"],
            [["spare" if r["rank"] is None else str(r["rank"]), r["rank_id"], r["node"],
              str(r["pid"]), r["state"], "-" if r["step"] is None else str(r["step"]),
              "-" if r["step_time_s"] is None else f"{r['step_time_s']:.3f} s",
              _age(r["last_heartbeat_age_s"])] for r in ranks])
    else:
        lines.append("no ranks registered")
    if view["plan_changes"]:
        lines += ["", "PLAN CHANGES"]
        lines += _table(
            ["TIME", "WHAT"],
            [[time.strftime("%H:%M:%S", time.localtime(c["time_unix_ms"] / 1000)), c["reason"]]
             for c in view["plan_changes"][-10:]])
    if view["failures"]:
        lines += ["", "RECENT FAILURES"]
        lines += _table(
            ["TIME", "KIND", "SUBJECT", "EVIDENCE"],
            [[time.strftime("%H:%M:%S", time.localtime(f["time_unix_ms"] / 1000)), f["kind"],
              f["subject"], f["evidence"]] for f in view["failures"][-10:]])
    for note in view["unreachable"]:
        lines.append(f"(could not ask {note})")
    return "\n".join(lines)


def _tls_from_env() -> Any:
    """The TLS files the CLI dials with ($STALWART_TLS_*), or None for plaintext."""
    from stalwart.daemon.config import TlsConfig

    env = os.environ
    cert, key, ca = (env.get(f"STALWART_TLS_{n}", "") for n in ("CERT", "KEY", "CA"))
    return TlsConfig(cert=cert, key=key, ca=ca) if cert and key and ca else None


def run(args: argparse.Namespace) -> int:
    import grpc

    from stalwart.client.daemon_client import DaemonUnavailable
    from stalwart.daemon.security.tls import diagnose

    target = _target(args)
    try:
        view = gather(target, args.timeout, args.local)
    except DaemonUnavailable as e:  # the TLS environment is incomplete or unreadable
        print(f"stalwart status: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        code = e.code()  # type: ignore[attr-defined]
        why = ""
        if code == grpc.StatusCode.UNAVAILABLE and not target.startswith("unix:"):
            why = diagnose(target, _tls_from_env(), timeout_s=args.timeout)
        if why:
            print(f"stalwart status: {why}", file=sys.stderr)
        else:
            print(f"stalwart status: no daemon answers at {target} "
                  f"({code.name}: {e.details()}); "  # type: ignore[attr-defined]
                  "start `stalwart daemon` or pass --address HOST:PORT / --socket PATH",
                  file=sys.stderr)
        return 1
    try:
        print(json.dumps(view, indent=2) if args.json else render(view), flush=True)
    except BrokenPipeError:
        # `stalwart status | head`: the reader has what it wanted.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0
