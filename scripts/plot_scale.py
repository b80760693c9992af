"""Log-log plot of `stalwart bench scale --json` figures: per-step bytes per daemon (new and
old design), coordinator CPU per step, commit p99 on this machine and the commit's
critical path on a cluster, against the number of daemons.

    python scripts/plot_scale.py out/scale.json docs/scale.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend


def main(source: Path, target: Path) -> None:
    figures = json.loads(source.read_text())
    points = figures["points"]
    n = [p["daemons"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.loglog(n, [p["old_bytes_per_daemon_per_step"] for p in points], "o--",
                label="old: every rank's record to every daemon")
    left.loglog(n, [p["bytes_per_daemon_per_step"] for p in points], "o-",
                label="split records: own records' copies + step record")
    left.loglog(n, [p["protocol_bytes_per_daemon_per_step"] for p in points], "s:",
                label="of which prepare + step record")
    left.set_xlabel("daemons (8 ranks each)")
    left.set_ylabel("bytes per daemon per step")
    left.legend(fontsize=7)
    right.loglog(n, [p["coordinator_cpu_s_per_step"] for p in points], "o-",
                 label="coordinator CPU per step")
    right.loglog(n, [p["commit_p99_s"] for p in points], "s-",
                 label="commit p99 here (2 cores host every daemon)")
    right.loglog(n, [p["commit_critical_path_s"] for p in points], "^-",
                 label="commit critical path (coordinator + depth x hop)")
    right.axhline(0.05, color="grey", lw=0.8, ls="--")
    right.axhline(0.25, color="grey", lw=0.8, ls=":")
    right.set_xlabel("daemons (8 ranks each)")
    right.set_ylabel("seconds")
    right.legend(fontsize=7)
    fig.suptitle(f"stalwart bench scale ({figures['machine']['cpus']} CPUs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
