"""Straggler detection: a rank whose step time stays far off its peers'.

Pure and clock-free: ranks' step times go in through `observe`; each call to
`close_window` compares every rank's window median with its peers' median and
MAD, and flags a rank only after `persistence` consecutive slow windows.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from stalwart.core.failures import Failure, FailureKind

__all__ = ["StragglerConfig", "StragglerDetector", "StragglerReport", "WindowVerdict"]

# MAD times this estimates the standard deviation of normally distributed data.
_MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """When a rank counts as a straggler."""

    threshold: float = 4.0
    """Robust z-score (distance from the peers' median in MADs) a slow window must exceed."""
    min_ratio: float = 1.3
    """...and the rank's median must also be this many times the peers' median."""
    noise_floor: float = 0.02
    """Spread assumed at least this fraction of the peers' median (peers with identical
    times would otherwise make any difference infinitely significant)."""
    persistence: int = 3
    """Consecutive slow windows before a rank is flagged (avoids flapping)."""
    min_samples: int = 2
    """Step times a rank needs in a window to be judged in it."""
    mark_as_failure: bool = False
    """Turn newly flagged stragglers into STRAGGLER failures for the coordinator."""


@dataclass(frozen=True)
class StragglerReport:
    """Why a rank is (or was) considered slow, from its latest window."""

    rank_id: str
    median_s: float
    peers_median_s: float
    robust_z: float
    windows: int

    @property
    def ratio(self) -> float:
        return self.median_s / self.peers_median_s if self.peers_median_s > 0 else float("inf")

    def evidence(self) -> str:
        return (f"step time {self.median_s:.3f} s vs peers' median {self.peers_median_s:.3f} s "
                f"({self.ratio:.1f}x, {self.robust_z:.1f} MADs) for {self.windows} "
                "consecutive windows")


@dataclass(frozen=True)
class WindowVerdict:
    """Outcome of one window: everyone flagged now, and what changed."""

    flagged: dict[str, StragglerReport]
    new: list[StragglerReport]
    cleared: list[str]
    failures: list[Failure]


def robust_z(value: float, peers: Iterable[float], noise_floor: float) -> tuple[float, float]:
    """(robust z-score of `value` against `peers`, peers' median); z > 0 means slower."""
    xs = list(peers)
    med = statistics.median(xs)
    mad = statistics.median(abs(x - med) for x in xs)
    scale = max(_MAD_TO_SIGMA * mad, noise_floor * abs(med), 1e-12)
    return (value - med) / scale, med


@dataclass
class StragglerDetector:
    """Sliding per-rank step-time windows and the persistence bookkeeping."""

    config: StragglerConfig = field(default_factory=StragglerConfig)
    generation: int = 0
    reporter: str = ""
    _samples: dict[str, list[float]] = field(default_factory=dict)
    _streak: dict[str, int] = field(default_factory=dict)
    _flagged: dict[str, StragglerReport] = field(default_factory=dict)

    def observe(self, rank_id: str, step_time_s: float) -> None:
        """Record one completed step's wall time (seconds) for a rank."""
        self._samples.setdefault(rank_id, []).append(step_time_s)

    def forget(self, rank_id: str) -> None:
        """Drop a rank that left the plan."""
        for table in (self._samples, self._streak, self._flagged):
            table.pop(rank_id, None)

    def close_window(self) -> WindowVerdict:
        """Judge the window that ends now and start a new one."""
        cfg = self.config
        medians = {r: statistics.median(xs) for r, xs in self._samples.items()
                   if len(xs) >= cfg.min_samples}
        self._samples = {}
        new: list[StragglerReport] = []
        cleared: list[str] = []
        for rank_id, median in sorted(medians.items()):
            peers = [m for r, m in medians.items() if r != rank_id]
            if not peers:
                continue
            z, peers_median = robust_z(median, peers, cfg.noise_floor)
            slow = z > cfg.threshold and median >= cfg.min_ratio * peers_median
            streak = self._streak.get(rank_id, 0) + 1 if slow else 0
            self._streak[rank_id] = streak
            if streak >= cfg.persistence:
                report = StragglerReport(rank_id, median, peers_median, z, streak)
                if rank_id not in self._flagged:
                    new.append(report)
                self._flagged[rank_id] = report
            elif not slow and self._flagged.pop(rank_id, None) is not None:
                cleared.append(rank_id)
        failures = [
            Failure(FailureKind.STRAGGLER, r.rank_id, r.evidence(), generation=self.generation,
                    reporter=self.reporter,
                    details={"ratio": r.ratio, "robust_z": r.robust_z, "windows": r.windows})
            for r in new
        ] if cfg.mark_as_failure else []
        return WindowVerdict(dict(self._flagged), new, cleared, failures)
