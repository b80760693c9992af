"""Specification of generation fencing: one check, one error, for every message kind."""

from __future__ import annotations

import pytest

from stalwart.core.generation import StaleGeneration, check_generation


def test_a_message_of_the_current_or_a_newer_generation_passes() -> None:
    check_generation(3, 3, "heartbeat of rank r0")
    check_generation(4, 3, "heartbeat of rank r0")  # this side learns the newer plan


def test_a_message_of_an_older_generation_is_refused_naming_both_and_what_to_do() -> None:
    with pytest.raises(StaleGeneration, match=r"capture of step 7 is from generation 2, but "
                                              r"the job is at generation 3; follow the current"):
        check_generation(2, 3, "capture of step 7")
