"""`stalwart status` shows daemons, ranks and their last heartbeat, as a table or JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from fixtures_daemon import DaemonFactory, daemon_env, free_port, wait_for

from stalwart.client.daemon_client import DaemonClient
from stalwart.daemon.status_cli import render

# Gossip often; judge ranks and peers leniently, since the machine may be busy.
FAST = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 30.0}
LIVE = ("alive", "late")


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stalwart.cli", "status", *args],
                          capture_output=True, text=True, timeout=30, env=daemon_env())


def test_status_covers_every_daemon_and_rank_of_the_cluster(
        daemon_factory: DaemonFactory) -> None:
    port_a, port_b = free_port(), free_port()
    a = daemon_factory.start("a", port=port_a, peers=(f"127.0.0.1:{port_b}",), settings=FAST)
    b = daemon_factory.start("b", port=port_b, peers=(f"127.0.0.1:{port_a}",), settings=FAST)
    on_a, on_b = DaemonClient(a.socket_target), DaemonClient(b.socket_target)
    try:
        id_a = on_a.register(env={"RANK": "0", "WORLD_SIZE": "2"}).rank_id
        id_b = on_b.register(env={"RANK": "1", "WORLD_SIZE": "2"}).rank_id
        on_a.report_step(41, 0.5)
        on_a.start_heartbeats()
        on_b.start_heartbeats()
        wait_for(lambda: a.rank(id_a).step == 41, 10, "daemon a to see step 41")
        wait_for(lambda: any(d.node == "b" and d.state == "up" for d in a.status().daemons),
                 10, "daemon a to see b")

        table = status("--socket", str(a.unix_socket))
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].startswith("stalwart ") and "2 daemons, 2 ranks" in lines[0]
        header = next(line for line in lines if line.startswith("RANK "))
        assert "LAST HEARTBEAT" in header and "STEP" in header
        row_a = next(line for line in lines if id_a in line).split()
        assert row_a[:4] == ["0", id_a, "a", id_a.split("/")[1]]
        assert row_a[4] in LIVE and row_a[5] == "41"
        assert row_a[-2:] == ["s", "ago"]
        assert any(id_b in line and " b " in line for line in lines)
        assert any(line.startswith("a ") and "coordinator" in line for line in lines)

        view = json.loads(status("--address", b.address, "--json").stdout)
        assert view["node"] == "b"
        assert {d["node"] for d in view["daemons"] if d["state"] in ("up", "suspect")} == {
            "a", "b"}
        ranks = {r["rank_id"]: r for r in view["ranks"]}
        assert ranks[id_a]["step"] == 41 and ranks[id_a]["node"] == "a"
        assert ranks[id_b]["rank"] == 1 and ranks[id_b]["last_heartbeat_age_s"] >= 0

        local = json.loads(status("--address", b.address, "--json", "--local").stdout)
        assert [r["rank_id"] for r in local["ranks"]] == [id_b]
    finally:
        on_a.close()
        on_b.close()


def test_status_into_a_closed_pipe_ends_quietly(daemon_factory: DaemonFactory) -> None:
    a = daemon_factory.start("a", settings=FAST)
    done = subprocess.run(
        f"{sys.executable} -m stalwart.cli status --socket {a.unix_socket} | head -1",
        shell=True, capture_output=True, text=True, timeout=30, env=daemon_env())
    assert done.stdout.startswith("stalwart ") and len(done.stdout.splitlines()) == 1
    assert done.stderr == "", done.stderr


def test_status_without_a_daemon_says_what_to_do(tmp_path) -> None:
    done = status("--socket", str(tmp_path / "none.sock"), "--timeout", "1")
    assert done.returncode == 1
    assert done.stdout == ""
    assert "no daemon answers at unix:" in done.stderr and "--address" in done.stderr


def test_table_lists_recent_failures_and_spares() -> None:
    view = {
        "node": "a", "version": "0.1.0", "generation": 2,
        "plan": {"generation": 2, "dp": 1, "pp": 1, "tp": 1, "resume_step": 4,
                 "reason": "replace a/10 with spare a/12", "stop": False, "completed": False,
                 "stop_message": "", "coordinator": "a", "spares": 1},
        "committed_step": 7, "storage": {"protection": "step 7 survives 1 more daemon losses"},
        "plan_changes": [{"time_unix_ms": 0, "reason": "replace: generation 1 -> 2"}],
        "daemons": [{"node": "a", "address": "h:1", "state": "up", "last_seen_age_s": None,
                     "coordinator": True, "ranks": 2}],
        "ranks": [
            {"rank_id": "a/10", "node": "a", "pid": 10, "rank": None, "state": "dead",
             "step": None, "step_time_s": None, "last_heartbeat_age_s": 3.04},
            {"rank_id": "a/11", "node": "a", "pid": 11, "rank": None, "state": "spare",
             "step": 0, "step_time_s": 0.0, "last_heartbeat_age_s": 0.2}],
        "failures": [{"time_unix_ms": 0, "kind": "process_exit", "subject": "a/10",
                      "evidence": "process 10 exited", "reporter": "a"}],
        "unreachable": ["b: UNAVAILABLE"],
    }
    text = render(view)
    assert "generation 2" in text and "3.0 s ago" in text
    assert "plan: generation 2, dp=1 pp=1 tp=1, 1 spare(s), resumed from step 4" in text
    assert "committed step: 7" in text and "protection: step 7 survives 1 more" in text
    assert "PLAN CHANGES" in text and "generation 1 -> 2" in text
    dead = next(line for line in text.splitlines() if line.startswith("spare  a/10")).split()
    assert dead[4:7] == ["dead", "-", "-"]  # no stale step for a dead rank
    assert any(line.split()[:2] == ["spare", "a/11"] for line in text.splitlines())
    assert "RECENT FAILURES" in text and "process 10 exited" in text
    assert "(could not ask b: UNAVAILABLE)" in text
