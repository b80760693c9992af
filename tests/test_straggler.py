"""Specification of straggler detection (pure, property-based where a brute force exists)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.core.failures import FailureKind
from stalwart.core.straggler import StragglerConfig, StragglerDetector

RANKS = ["r0", "r1", "r2", "r3"]


def feed(det: StragglerDetector, times: dict[str, float], samples: int = 3):
    for rank, t in times.items():
        for _ in range(samples):
            det.observe(rank, t)
    return det.close_window()


def test_a_persistently_slow_rank_is_flagged_after_k_windows_not_before():
    det = StragglerDetector(StragglerConfig(persistence=3))
    times = {"r0": 0.10, "r1": 0.11, "r2": 0.10, "r3": 0.35}
    assert feed(det, times).flagged == {}
    assert feed(det, times).flagged == {}
    third = feed(det, times)
    assert [r.rank_id for r in third.new] == ["r3"]
    assert third.flagged["r3"].ratio > 3 and third.flagged["r3"].windows == 3
    assert feed(det, times).new == []  # still flagged, reported once


def test_a_flagged_rank_clears_when_it_catches_up():
    det = StragglerDetector(StragglerConfig(persistence=1))
    assert "r3" in feed(det, {"r0": 0.1, "r1": 0.1, "r3": 0.5}).flagged
    back = feed(det, {"r0": 0.1, "r1": 0.1, "r3": 0.1})
    assert back.cleared == ["r3"] and back.flagged == {}


def test_marking_as_failure_emits_one_straggler_failure_with_evidence():
    det = StragglerDetector(StragglerConfig(persistence=2, mark_as_failure=True), generation=4,
                            reporter="n0")
    times = {"r0": 0.2, "r1": 0.2, "r2": 0.9}
    assert feed(det, times).failures == []
    (failure,) = feed(det, times).failures
    assert failure.kind is FailureKind.STRAGGLER and failure.subject == "r2"
    assert failure.generation == 4 and "4.5x" in failure.evidence and "0.900 s" in failure.evidence
    assert feed(det, times).failures == []


def test_two_ranks_suffice_to_judge_each_other():
    det = StragglerDetector(StragglerConfig(persistence=1))
    assert list(feed(det, {"r0": 0.1, "r1": 0.3}).flagged) == ["r1"]


def test_ranks_with_too_few_samples_are_not_judged_and_keep_their_streak():
    det = StragglerDetector(StragglerConfig(persistence=2, min_samples=2))
    feed(det, {"r0": 0.1, "r1": 0.1, "r2": 0.5})
    det.observe("r0", 0.1)
    det.observe("r1", 0.1)
    det.observe("r1", 0.1)
    det.observe("r2", 0.5)  # one sample only: skipped this window
    assert det.close_window().flagged == {}
    assert "r2" in feed(det, {"r0": 0.1, "r1": 0.1, "r2": 0.5}).new[0].rank_id


def test_a_forgotten_rank_is_no_longer_reported():
    det = StragglerDetector(StragglerConfig(persistence=1))
    feed(det, {"r0": 0.1, "r1": 0.1, "r2": 0.6})
    det.forget("r2")
    assert feed(det, {"r0": 0.1, "r1": 0.1}).flagged == {}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.floats(0.95, 1.05), min_size=4, max_size=4), min_size=1,
                max_size=8), st.floats(1e-3, 1e3))
def test_ranks_within_five_percent_of_each_other_are_never_flagged(windows, scale):
    det = StragglerDetector(StragglerConfig(persistence=1))
    for window in windows:
        verdict = feed(det, {r: t * scale for r, t in zip(RANKS, window, strict=True)})
        assert verdict.flagged == {}


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.integers(1, 10))
def test_alternating_slow_and_normal_windows_never_flap_into_a_flag(persistence, rounds):
    det = StragglerDetector(StragglerConfig(persistence=persistence))
    for i in range(rounds):
        slow = 0.5 if i % 2 == 0 else 0.1
        assert feed(det, {"r0": 0.1, "r1": 0.1, "r2": slow}).flagged == {}


def brute_slow(rank: str, medians: dict[str, float], cfg: StragglerConfig) -> bool:
    """The criterion written out by hand: sorted-list medians of the other ranks."""
    def median(xs):
        xs = sorted(xs)
        n = len(xs)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    peers = [m for r, m in medians.items() if r != rank]
    med = median(peers)
    mad = median([abs(p - med) for p in peers])
    scale = max(1.4826 * mad, cfg.noise_floor * med, 1e-12)
    return (medians[rank] - med) / scale > cfg.threshold and medians[rank] >= cfg.min_ratio * med


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.1, 0.11, 0.12, 0.2, 0.3, 0.6, 1.0]), min_size=4,
                         max_size=4), min_size=1, max_size=7), st.integers(1, 3))
def test_flagged_set_equals_brute_force_over_the_last_k_windows(windows, persistence):
    """A rank is flagged exactly when its last `persistence` windows were all slow."""
    cfg = StragglerConfig(persistence=persistence)
    det = StragglerDetector(cfg)
    history: dict[str, list[bool]] = {r: [] for r in RANKS}
    for window in windows:
        medians = dict(zip(RANKS, window, strict=True))
        verdict = feed(det, medians)
        for r in RANKS:
            history[r].append(brute_slow(r, medians, cfg))
        expected = {r for r, h in history.items()
                    if len(h) >= persistence and all(h[-persistence:])}
        assert set(verdict.flagged) == expected
