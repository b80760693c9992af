"""The daemon hears of a rank process's exit the moment it happens (a pidfd per watched
process), not at the next liveness tick. A real process, ended with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from stalwart.daemon.recovery.exits import ExitWatch

WAIT_S = 30.0  # a deadline for a loaded 2-core machine; the wake itself takes microseconds

pidfd = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open "
                           "(Linux 5.3+); without it the periodic check alone finds exits")


@pidfd
def test_a_killed_process_wakes_the_check_at_once_and_is_no_longer_watched() -> None:
    async def scenario() -> tuple[set[int], set[int]]:
        woke = asyncio.Event()
        watch = ExitWatch(woke.set)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            watch.follow([proc.pid])
            before = watch.watched
            assert not woke.is_set()
            os.kill(proc.pid, signal.SIGKILL)
            await asyncio.wait_for(woke.wait(), WAIT_S)
            return before, watch.watched
        finally:
            proc.kill()
            proc.wait()
            watch.close()

    before, after = asyncio.run(scenario())
    assert len(before) == 1 and after == set()


@pidfd
def test_following_a_new_set_drops_the_old_pids_and_a_gone_pid_wakes_the_check() -> None:
    async def scenario() -> tuple[set[int], bool]:
        woke = asyncio.Event()
        watch = ExitWatch(woke.set)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            watch.follow([proc.pid])
            watch.follow([])  # the rank left: nothing to watch
            dropped = watch.watched
            gone = subprocess.Popen([sys.executable, "-c", "pass"])
            gone.wait()
            watch.follow([gone.pid])  # already over when watched: the check runs now
            return dropped, woke.is_set()
        finally:
            proc.kill()
            proc.wait()
            watch.close()

    dropped, woke = asyncio.run(scenario())
    assert dropped == set() and woke
