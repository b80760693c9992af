"""`stalwart run`, the per-host launcher: one per host next to that host's daemon, the
torchrun environment for its ranks and spares, survivors never ended when a sibling
dies, the job's status as its exit code with a one-line reason."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.client.local_cluster import LocalCluster, wait_until

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "examples/classifier/train.py")


def launch(cluster: LocalCluster, tmp_path: Path, spares_on_last: int = 0, steps: int = 24,
           own_pids: bool = False) -> list[tuple[subprocess.Popen, Path]]:
    """One `stalwart run` per daemon (host), each with one rank; with `own_pids`, each in
    a pid namespace of its own, as in a container: its processes get the same pids
    every time it starts."""
    out = []
    inside = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"] if own_pids else []
    for node in cluster.daemons:
        log = tmp_path / f"run-{node.name}.log"
        spares = spares_on_last if node is cluster.daemons[-1] else 0
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [*inside, sys.executable, "-m", "stalwart.cli", "run",
                 "--nnodes", str(cluster.nodes),
                 "--node-rank", str(node.index), "--nproc-per-node", "1",
                 "--spares", str(spares), "--socket", str(node.socket),
                 # the capture threads on a CPU of their own, as a host that gives
                 # its daemon cores would run them
                 "--capture-cpus", str(max(os.sched_getaffinity(0))), SCRIPT,
                 "--steps", str(steps), "--global-batch", "16"],
                stdout=f, stderr=subprocess.STDOUT,
                env={**os.environ, "STALWART_STEP_LOG": "1", "OMP_NUM_THREADS": "1"})
        out.append((proc, log))
    return out


def digests(runs: list[tuple[subprocess.Popen, Path]]) -> set[str]:
    return {m for _, log in runs
            for m in re.findall(r"param_digest ([0-9a-f]{64})", log.read_text())}


def run_job(tmp_path: Path, *, kill_rank0_after: int | None = None) -> tuple[list, list]:
    cluster = LocalCluster(nodes=2, workdir=tmp_path / "cluster")
    try:
        cluster.start_daemons()
        runs = launch(cluster, tmp_path, spares_on_last=1 if kill_rank0_after else 0)
        if kill_rank0_after is not None:
            def rank0_pid() -> int:
                st = cluster.daemons[0].status()
                live = [r for r in (st.ranks if st else []) if r.rank == 0 and not r.spare
                        and r.step >= kill_rank0_after]
                return live[0].pid if live else 0

            # Rank 0 also serves the store its generation started from.
            os.kill(wait_until(rank0_pid, 120, "rank 0 to take its steps"), signal.SIGKILL)
        for proc, _ in runs:
            proc.wait(timeout=240)
        codes = [proc.returncode for proc, _ in runs]
        return codes, runs
    finally:
        for proc, _ in runs if "runs" in locals() else []:
            if proc.poll() is None:
                proc.kill()
        cluster.close()


@pytest.mark.multiprocess
def test_two_hosts_survive_the_loss_of_the_rank_0_host_process_bitwise(tmp_path: Path) -> None:
    codes, base = run_job(tmp_path / "base")
    assert codes == [0, 0], [log.read_text()[-2000:] for _, log in base]
    codes, runs = run_job(tmp_path / "fault", kill_rank0_after=5)
    logs = [log.read_text() for _, log in runs]
    # The launcher of the killed rank ends nobody else and reports the job's outcome.
    assert codes == [0, 0], [text[-2000:] for text in logs]
    assert all("stalwart run: the job completed: its last step 24 is committed" in text
               for text in logs)
    assert len(digests(runs)) == 1 and digests(runs) == digests(base)


@pytest.mark.multiprocess
def test_a_completed_job_launched_again_resumes_from_its_last_step_and_its_spare_leaves(
        tmp_path: Path) -> None:
    # Daemons that outlive jobs (systemd, a DaemonSet) still hold the completed job: its
    # ranks started again wait for each other, restore its last step, and train on to a
    # longer length or, at the same length, return that state. Daemons started again on
    # the same data dirs (the hosts rebooted) resume it the same way, although no step
    # commits to end it: the ranks' leaving at their last step does, or the spare would
    # wait for a role forever, and its host's launcher with it. Each launcher runs in a
    # pid namespace of its own (as in a pod), so a relaunch's processes have the pids the
    # ended ones had: the daemon tells them apart.
    own_pids = os.geteuid() == 0 and shutil.which("unshare") is not None
    token = secrets.token_urlsafe(24)
    runs: list[tuple[subprocess.Popen, Path]] = []
    finals = {}

    def job(cluster: LocalCluster, name: str, steps: int) -> None:
        nonlocal runs
        (tmp_path / name).mkdir()
        runs = launch(cluster, tmp_path / name, spares_on_last=1, steps=steps,
                      own_pids=own_pids)
        for proc, _ in runs:
            proc.wait(timeout=240)
        logs = [log.read_text() for _, log in runs]
        assert [proc.returncode for proc, _ in runs] == [0, 0], [t[-2000:] for t in logs]
        assert all(f"the job completed: its last step {steps} is committed" in text
                   for text in logs), [t[-2000:] for t in logs]
        finals[name] = digests(runs)
        assert len(finals[name]) == 1

    for daemons in ("kept", "restarted"):
        cluster = LocalCluster(nodes=2, workdir=tmp_path / "cluster",
                               env={"STALWART_TOKEN": token})
        try:
            cluster.start_daemons()
            if daemons == "kept":
                job(cluster, "first", 6)
                job(cluster, "same", 6)
                job(cluster, "longer", 9)
                ids = [r.rank_id for node in cluster.daemons for r in node.status().ranks]
                assert not own_pids or any("." in i.rpartition("/")[2] for i in ids), ids
            else:
                job(cluster, "restarted", 9)
        finally:
            for proc, _ in runs:
                if proc.poll() is None:
                    proc.kill()
            cluster.close()
    assert finals["same"] == finals["first"] != finals["longer"] == finals["restarted"]


@pytest.mark.parametrize("flags,message", [
    (["--master-addr", "h"], "--master-addr is not taken: hosts find the job through"),
    (["--rdzv-backend", "c10d"], "--rdzv-backend is not taken"),
    (["--max-restarts", "3"], "--max-restarts is not taken: survivors are never restarted"),
    (["--nnodes", "1:4"], "--nnodes 1:4: give the number of hosts"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is outside 0..1"),
    (["--socket", "/nonexistent/d.sock"], "no daemon socket at /nonexistent/d.sock"),
    (["--capture-cpus", "4096"], "--capture-cpus='4096': this machine has CPUs 0-"),
    (["--capture-cpus", "a,b"], "--capture-cpus='a,b': give CPU numbers like"),
])
def test_flags_the_launcher_refuses_get_one_line_naming_them(flags, message) -> None:
    proc = subprocess.run([sys.executable, "-m", "stalwart.cli", "run", *flags, SCRIPT],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr, proc.stderr


@pytest.mark.multiprocess
def test_sigterm_to_the_launcher_reaches_every_process_it_started(tmp_path: Path) -> None:
    cluster = LocalCluster(nodes=1, workdir=tmp_path / "cluster")
    try:
        cluster.start_daemons()
        node = cluster.daemons[0]
        proc = subprocess.Popen(
            [sys.executable, "-m", "stalwart.cli", "run", "--nproc-per-node", "2", "--spares",
             "1", "--socket", str(node.socket), SCRIPT, "--steps", "100000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def children() -> list[int]:
            st = node.status()
            return [r.pid for r in (st.ranks if st else [])
                    if Path(f"/proc/{r.pid}").exists()]

        started = wait_until(lambda: len(children()) == 3 and children(), 120,
                             "two ranks and a spare to register")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in started), 30,
                   "the ranks and the spare to end")
        assert proc.returncode != 0  # the job did not complete
    finally:
        if "proc" in locals() and proc.poll() is None:
            proc.kill()
        cluster.close()
