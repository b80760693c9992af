"""The fuzz bench as a test: 10,000 inputs to every RPC of a live daemon, with and without
credentials, on both listeners; nothing crashes, nothing answers UNKNOWN, memory stays
bounded (issue 19)."""

from __future__ import annotations

import pytest

from stalwart.bench import fuzz

MEMORY_BUDGET_BYTES = 64 << 20


@pytest.mark.fuzz
def test_ten_thousand_fuzzed_inputs_crash_nothing_and_answer_no_unknown() -> None:
    figures = fuzz.run(quick=True)
    assert figures["inputs"] >= 10_000
    assert len(figures["by_method"]) == figures["rpcs"] >= 18
    assert (figures["crashes"], figures["unknown"], figures["internal"]) == (0, 0, 0), \
        figures["codes"]
    assert figures["daemon_alive_after"]
    assert figures["rss_growth_bytes"] < MEMORY_BUDGET_BYTES
    # Every credential mode reached the daemon: refusals of each kind were seen.
    assert {"UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT", "OK"} <= set(
        figures["codes"])
