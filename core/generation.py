"""Generations fence everything: the one check, and the one error a stale sender gets.

A generation is the number of the plan a message was made under. Whatever comes from
an older one (a heartbeat, a capture, a prepare, a plan, a failure report) is refused
with `StaleGeneration`; the sender drops its old process groups and follows the plan.
"""

from __future__ import annotations


class StaleGeneration(RuntimeError):
    """A message, plan or process group belongs to a generation the job has left behind."""


def check_generation(got: int, current: int, what: str) -> None:
    """Raise StaleGeneration when `what` (e.g. "heartbeat of rank r0") comes from a
    generation older than `current`; a newer one passes (this side has not installed
    the newest plan yet and will learn it)."""
    if got < current:
        raise StaleGeneration(
            f"{what} is from generation {got}, but the job is at generation {current}; "
            "follow the current plan (watch the plan or register again)")
