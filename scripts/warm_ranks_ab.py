"""Launch to the last trained step of a local dp=2 pp=2 job with a spare, its ranks
forked from the warm template against each started cold, alternated in one process.

    .venv/bin/python scripts/warm_ranks_ab.py [RUNS]   # prints JSON: seconds per run
"""

from __future__ import annotations

import json
import sys
import time

from stalwart.client.local_cluster import LocalCluster, wait_until

MICRO = {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "seq_len": 16}
SPEC = {"model": "tiny", "model_overrides": MICRO, "layout": {"dp": 2, "pp": 2, "tp": 1},
        "steps": 10, "faults": [], "collective_timeout_s": 4.0}


def launch_to_last_step(warm: bool) -> float:
    cluster = LocalCluster(nodes=2, warm_ranks=warm)
    try:
        cluster.start_daemons()
        start = time.monotonic()
        cluster.launch(SPEC, world=4, spares=1)
        wait_until(lambda: all(r.result() for r in cluster.ranks if r.rank >= 0), 300,
                   "every rank to train its last step")
        return time.monotonic() - start
    finally:
        cluster.close()


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    out: dict[str, list[float]] = {"warm_s": [], "cold_s": []}
    for _ in range(runs):
        for warm in (True, False):
            out["warm_s" if warm else "cold_s"].append(round(launch_to_last_step(warm), 2))
    out["cold_over_warm"] = round(sum(out["cold_s"]) / sum(out["warm_s"]), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
