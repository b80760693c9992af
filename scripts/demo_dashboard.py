"""Run a short demo job with a fault under a real Prometheus and draw the overview dashboard.

Starts a local cluster (daemons serving /metrics), Debian `prometheus` scraping
them every second on free loopback ports, trains a tiny GPT with a spare while one
rank is killed, then renders the dashboard from the scraped data:
    python scripts/demo_dashboard.py --out docs/overview-dashboard.png [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_api import PrometheusError, scraped_all

SCRIPTS = Path(__file__).resolve().parent
SCRAPE_S = 1.0


SMALLEST = {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "seq_len": 16}


def tiny_spec(steps: int, kill_rank: int, kill_step: int,
              overrides: dict[str, int] | None = None) -> dict[str, Any]:
    """A dp=2 x pp=2 job on the tiny GPT (shrunk by `overrides`) that SIGKILLs
    `kill_rank` after `kill_step`."""
    return {"model": "tiny", "model_overrides": overrides or {},
            "train": {"global_batch": 8, "corpus_bytes": 65536, "seed": 0},
            "layout": {"dp": 2, "pp": 2, "tp": 1, "schedule": "1f1b", "microbatches": 2},
            "steps": steps, "collective_timeout_s": 10.0,
            "faults": [{"kind": "kill", "target": "rank", "index": kill_rank,
                        "step": kill_step}]}


def wait(what: str, check: Callable[[], object], timeout_s: float) -> object:
    """Poll `check` until truthy; raises TimeoutError naming `what`."""
    end = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        try:
            value = check()
        except (OSError, urllib.error.URLError, PrometheusError) as exc:
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}"
                               + (f"; the last try failed: {last}" if last else "")) from last
        time.sleep(0.2)  # polling interval of a deadline-bound wait


def start_prometheus(targets: list[str], root: Path, port: int,
                     scrape_s: float = SCRAPE_S) -> subprocess.Popen[bytes]:
    """Debian `prometheus` scraping `targets` (HOST:PORT) every `scrape_s` seconds; on
    return it has scraped every target, so what happens next is on record.

    Prometheus applies its scrape targets only some seconds after it reports ready
    (about 5 s), so a job launched at "ready" can run its first steps, or lose a
    rank, before the first scrape."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed; run scripts/install-system-deps.sh")
    root.mkdir(parents=True, exist_ok=True)
    (root / "prometheus.yml").write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": f"{scrape_s * 1000:.0f}ms",
                   "scrape_timeout": f"{scrape_s * 1000:.0f}ms",
                   "evaluation_interval": f"{scrape_s * 1000:.0f}ms"},
        "scrape_configs": [{"job_name": "stalwart",
                            "static_configs": [{"targets": targets}]}]}))
    with open(root / "prometheus.log", "ab") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={root / 'prometheus.yml'}",
             f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait("Prometheus to become ready",
             lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200, 30)
        wait(f"Prometheus to scrape {', '.join(targets)} (its log: {root / 'prometheus.log'})",
             lambda: scraped_all(url, targets), 30)
    except BaseException:
        stop(proc)
        raise
    return proc


def any_rank_registered(cluster: Any) -> float | None:
    """Unix time now, once some daemon lists a rank (polled at 0.2 s)."""
    registered = any(status.ranks for n in cluster.daemons if (status := n.status()))
    return time.time() if registered else None


def roles_done(cluster: Any, steps: int, world: int) -> bool:
    """Every role trained the last step (the killed rank's role through its spare)."""
    done = 0
    for r in cluster.ranks:
        result = (r.result() or {}) if r.proc.poll() is not None else {}
        done += str(steps) in result.get("losses", {})
    return done >= world


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/dashboard.png"),
                        help="PNG to write (default out/dashboard.png; the README's image is "
                             "docs/overview-dashboard.png)")
    parser.add_argument("--dashboard", default="overview", help="overview, faults or storage")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kill-step", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the job")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs here")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(SCRIPTS))
    import render_dashboard

    from stalwart.client.local_cluster import LocalCluster
    from stalwart.client.ports import free_port

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="stw-dash-"))
    cluster = LocalCluster(nodes=2, workdir=workdir / "cluster", metrics=True)
    prometheus = None
    try:
        cluster.start_daemons()
        port = free_port()
        prometheus = start_prometheus(
            [f"127.0.0.1:{n.metrics_port}" for n in cluster.daemons], workdir / "prom", port)
        url = f"http://127.0.0.1:{port}"
        cluster.launch(tiny_spec(args.steps, 1, args.kill_step), world=4, spares=1)
        # The picture starts a few scrapes before the first rank registers (torch start-up
        # before that is idle time) and ends a few scrapes after the last step.
        begun = wait("a rank to register", lambda: any_rank_registered(cluster), 120)
        wait("every role to finish training", lambda: roles_done(cluster, args.steps, 4),
             args.timeout)
        time.sleep(3 * SCRAPE_S)  # the last values reach Prometheus
        minutes = (time.time() - begun + 3 * SCRAPE_S) / 60
        with_data = render_dashboard.render(url, args.dashboard, args.out, minutes, None)
        print(f"wrote {args.out} ({with_data} panels with data) from a {args.steps}-step run "
              f"with rank 1 killed after step {args.kill_step}; logs in {cluster.workdir}")
    except (TimeoutError, RuntimeError, PrometheusError) as exc:
        print(f"demo_dashboard: {exc}; logs are in {workdir}", file=sys.stderr)
        return 1
    finally:
        if prometheus is not None:
            stop(prometheus)
        cluster.close(keep_workdir=True)
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
