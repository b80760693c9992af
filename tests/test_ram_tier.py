"""The RAM tier: bounded in bytes, oldest first, sparing protected steps while it can."""

from __future__ import annotations

from stalwart.daemon.snapshot.ram_tier import RamTier


def test_evicts_oldest_unprotected_first_then_protected() -> None:
    tier = RamTier(300, protected=lambda steps: {1} & steps)
    for step in (1, 2, 3):
        tier.put((step, 0, 0), bytes(100))
    tier.put((4, 0, 0), bytes(100))  # over budget: step 2 goes, step 1 is spared
    assert tier.steps() == {1, 3, 4} and tier.used == 300
    tier.put((5, 0, 0), bytes(250))  # only dropping protected data makes room
    assert tier.steps() == {5} and tier.used == 250


def test_payload_larger_than_the_budget_is_not_cached() -> None:
    tier = RamTier(10, protected=lambda steps: set())
    tier.put((1, 0, 0), bytes(11))
    assert tier.get((1, 0, 0)) is None and tier.used == 0


def test_drop_steps_forgets_every_chunk_of_those_steps() -> None:
    tier = RamTier(1000, protected=lambda steps: set())
    for key in [(1, 0, 0), (1, 1, 0), (2, 0, 0)]:
        tier.put(key, b"x")
    tier.drop_steps([1])
    assert tier.steps() == {2} and tier.used == 1
