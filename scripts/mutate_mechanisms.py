"""Disable one recovery mechanism at a time, in place, run the test named for it, restore
the file: every mechanism must have a test that fails without it.

    .venv/bin/python scripts/mutate_mechanisms.py [NAME ...]   # all, or the named ones

Prints CAUGHT or MISSED per mechanism. Do not run it beside other work on the same tree.
"""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
E2E = "tests/test_recovery_e2e.py::"
LIVENESS = "tests/test_liveness.py::"
READ_AROUND = "tests/test_erasure_cluster.py::test_corrupt_shard_and_frozen_peer_are_read_around"

# (mechanism, file, text, replacement that disables it, the test that must fail)
MUTANTS = [
    ("fencing", "daemon/recovery/fencing.py",
     '    def fence(self, record: RankRecord) -> None:\n        """',
     '    def fence(self, record: RankRecord) -> None:\n        return\n        """',
     E2E + "test_a_hung_rank_is_fenced_and_replaced"),
    ("gpu monitor", "daemon/recovery/gpu_health.py",
     '        self._inject_path = Path(spec) if spec.startswith("/") else None',
     "        self._inject_path = None",
     E2E + "test_an_nvml_gpu_fault_replaces_the_rank_on_that_gpu"),
    ("fold-in", "core/decide.py",
     "    relevant = [f for f in failures if _is_relevant(",
     "    in_flight = None\n    relevant = [f for f in failures if _is_relevant(",
     E2E + "test_a_second_failure_during_recovery_is_folded_in"),
    ("read-around corrupt shard", "daemon/snapshot/shard_reader.py",
     '                        failed[c.index] = f"{_where(c)}: {task.exception()}"',
     "                        raise task.exception()", READ_AROUND),
    ("read-around frozen peer", "daemon/snapshot/shard_reader.py",
     "                    launch()  # hedge: a slow holder gets company",
     "                    pass  #", READ_AROUND),
    ("recomputation", "client/layers.py",
     '            x = maybe_checkpoint(self.recompute == "full", block, x)',
     "            x = block(x)",
     "tests/test_model_data.py::test_recomputation_keeps_less_and_gives_the_same_gradients"),
    ("hang detector", "client/agent.py",
     '        if "timed out" in text.lower() or "timeout" in text.lower():',
     "        if False:", E2E + "test_a_hung_rank_is_fenced_and_replaced"),
    ("stall detector", "daemon/recovery/registry.py",
     "            if (stalled := self._stalled(record, now)) is not None:",
     "            if (stalled := None) is not None:",
     E2E + "test_a_hang_of_a_jobs_only_rank_is_detected_as_a_stall_and_replaced"),
    ("process-exit detector", "daemon/recovery/registry.py",
     "            if record.process is not None and not process_alive(record.process):",
     "            if False:", LIVENESS + "test_registry_declares_an_exited_rank_process_dead"),
    ("heartbeat detector", "daemon/recovery/registry.py",
     "            if state == DEAD:\n                found.append(self._declare_dead(",
     "            if False:\n                found.append(self._declare_dead(",
     LIVENESS + "test_silent_rank_goes_late_then_dead_once_with_a_heartbeat_missed_failure"),
    ("peer-lost detector", "daemon/recovery/membership.py",
     "            if state == LOST:\n                found.append(",
     "            if False:\n                found.append(",
     LIVENESS + "test_peers_move_from_up_to_suspect_to_lost_with_one_failure"),
    ("pause learning", "daemon/recovery/membership.py",
     "        if last is not None and now - last > self.timeout_s:", "        if False:",
     "tests/test_paused_daemon.py"),
]


def main(only: list[str]) -> int:
    missed = 0
    for name, path, old, new, test in MUTANTS:
        if only and name not in only:
            continue
        f = ROOT / path
        text = f.read_text()
        if old not in text:
            print(f"{name}: its code in {path} changed; update this script", flush=True)
            missed += 1
            continue
        f.write_text(text.replace(old, new, 1))
        try:
            r = subprocess.run([str(ROOT / ".venv/bin/python"), "-m", "pytest", "-q", "-x",
                                "-p", "no:cacheprovider", test], cwd=ROOT, capture_output=True,
                               text=True, timeout=900)
        finally:
            f.write_text(text)
        lines = r.stdout.strip().splitlines()
        verdict = "CAUGHT" if r.returncode else "MISSED"
        missed += not r.returncode
        print(f"{name:26s} {verdict}  {test}  ({lines[-1] if lines else ''})", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
