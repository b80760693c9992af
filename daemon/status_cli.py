"""`stalwart status`: the daemons, ranks and last heartbeats of a job, as a table or JSON.

Asks one daemon (the local Unix socket by default), then each peer that daemon
sees alive, so the table covers the ranks of every node it can reach.
"""

from __future__ import annotations

import argparse
import json
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

    from stalwart.client.daemon_client import tls_credentials
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

    return {
        "node": first.node,
        "version": first.version,
        "generation": max(r.generation for r in replies),
        "daemons": [
            {"node": d.node, "address": d.address, "state": d.state,
             "last_seen_age_s": None if d.last_seen_age_s < 0 or i == 0 else d.last_seen_age_s,
             "coordinator": d.coordinator,
             "ranks": sum(1 for r in ranks.values() if r.node == d.node)}
            for i, d in enumerate(first.daemons)],
        "ranks": [
            {"rank_id": r.rank_id, "node": r.node, "pid": r.pid,
             "rank": None if r.spare else r.rank, "state": r.state, "step": r.step,
             "step_time_s": r.step_time_s, "last_heartbeat_age_s": r.last_heartbeat_age_s}
            for r in sorted(ranks.values(), key=lambda r: (r.spare, r.rank, r.rank_id))],
        "failures": [
            {"time_unix_ms": f.time_unix_ms,
             "kind": common_pb2.FailureEvent.Kind.Name(f.kind).lower(),
             "subject": f.subject, "evidence": f.evidence, "reporter": f.reporter}
            for f in sorted(failures.values(), key=lambda f: f.time_unix_ms)],
        "unreachable": unreachable,
    }


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
             f"{view['generation']} - {len(daemons)} daemons, {len(ranks)} ranks", ""]
    lines += _table(
        ["DAEMON", "ADDRESS", "STATE", "LAST SEEN", "RANKS", "ROLE"],
        [[d["node"] or "?", d["address"], d["state"], _age(d["last_seen_age_s"]),
          str(d["ranks"]), "coordinator" if d["coordinator"] else ""] for d in daemons])
    lines.append("")
    if ranks:
        lines += _table(
            ["RANK", "RANK ID", "NODE", "PID", "STATE", "STEP", "STEP TIME", "LAST HEARTBEAT"],
            [["spare" if r["rank"] is None else str(r["rank"]), r["rank_id"], r["node"],
              str(r["pid"]), r["state"], str(r["step"]), f"{r['step_time_s']:.3f} s",
              _age(r["last_heartbeat_age_s"])] for r in ranks])
    else:
        lines.append("no ranks registered")
    if view["failures"]:
        lines += ["", "RECENT FAILURES"]
        lines += _table(
            ["TIME", "KIND", "SUBJECT", "EVIDENCE"],
            [[time.strftime("%H:%M:%S", time.localtime(f["time_unix_ms"] / 1000)), f["kind"],
              f["subject"], f["evidence"]] for f in view["failures"][-10:]])
    for note in view["unreachable"]:
        lines.append(f"(could not ask {note})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import grpc

    target = _target(args)
    try:
        view = gather(target, args.timeout, args.local)
    except grpc.RpcError as e:
        print(f"stalwart status: no daemon answers at {target} "
              f"({e.code().name}: {e.details()}); "  # type: ignore[attr-defined]
              "start `stalwart daemon` or pass --address HOST:PORT / --socket PATH",
              file=sys.stderr)
        return 1
    print(json.dumps(view, indent=2) if args.json else render(view))
    return 0
