"""The daemon hears of a rank process's exit the moment it happens (a pidfd per watched
process, and per few of its threads), not at the next liveness tick, and a killed process
reads as ended before the kernel has freed its memory. Real processes, ended with
SIGKILL; /proc as the kernel writes it for the states no test can hold a process in."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.daemon.recovery.exits import PIDFD_THREAD, THREADS_WATCHED, ExitWatch
from stalwart.daemon.recovery.liveness import ProcessIdentity, process_identity

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


THREADED = """
import sys, threading
memory = bytearray(int(sys.argv[1]) << 20)  # its end frees this first
for i in range(0, len(memory), 4096):
    memory[i] = 1
done = threading.Event()
workers = [threading.Thread(target=done.wait, daemon=True) for _ in range(6)]
for w in workers:
    w.start()
print("ready", flush=True)
sys.stdin.readline()  # a line: one worker finishes its work and ends
done.set()
for w in workers:
    w.join()
print("joined", flush=True)
sys.stdin.readline()
"""


def thread_pidfds() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid(), PIDFD_THREAD))
    except (AttributeError, OSError):
        return False
    return True


needs_thread_pidfds = pytest.mark.skipif(
    not thread_pidfds(), reason="thread pidfds need Linux 6.9+; before, the process pidfd "
    "alone is watched (the tests above)")


@contextlib.contextmanager
def watched_threaded(memory_mb: int, on_exit: Callable[[], object]
                     ) -> Iterator[tuple[subprocess.Popen[str], ExitWatch]]:
    """A process with a few threads and `memory_mb` of its own memory, watched."""
    proc = subprocess.Popen([sys.executable, "-c", THREADED, str(memory_mb)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    watch = ExitWatch(on_exit)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        watch.follow([proc.pid])
        yield proc, watch
    finally:
        proc.kill()
        proc.wait()
        watch.close()


@needs_thread_pidfds
def test_a_killed_process_is_seen_ending_through_its_threads_before_its_memory_is_freed(
        ) -> None:
    # SIGKILL ends every thread but the last at once; the last frees the process's memory
    # (1 GB here) before the process counts as exited. The first wake comes from a
    # watched thread while the process is still watched, and the process already reads
    # as ending (no identity): the rank is declared dead without waiting for the kernel.
    async def scenario() -> tuple[bool, int, ProcessIdentity | None]:
        first: list[tuple[bool, ProcessIdentity | None]] = []
        woke = asyncio.Event()
        seen: dict[str, Any] = {}

        def on_exit() -> None:
            if not first:
                pid = seen["proc"].pid
                first.append((pid in seen["watch"].watched, process_identity(pid)))
            woke.set()

        with watched_threaded(1024, on_exit) as (proc, watch):
            seen.update(proc=proc, watch=watch)
            threads = len(watch.threads_watched(proc.pid))
            os.kill(proc.pid, signal.SIGKILL)
            await asyncio.wait_for(woke.wait(), WAIT_S)
        (still_watched, identity), = first
        return still_watched, threads, identity

    still_watched, threads, identity = asyncio.run(scenario())
    assert threads == THREADS_WATCHED
    assert still_watched, "the process pidfd woke the check first: threads were not watched"
    assert identity is None, "the killed process still read as running"


@needs_thread_pidfds
def test_a_thread_that_ends_its_work_wakes_the_check_but_ends_nothing() -> None:
    # Threads come and go in a live rank: one ending wakes the check, which finds the
    # process running; the ended threads are no longer watched, the main thread still is.
    async def scenario() -> tuple[ProcessIdentity | None, set[int], set[int]]:
        woke = asyncio.Event()
        with watched_threaded(1, woke.set) as (proc, watch):
            assert proc.stdin is not None and proc.stdout is not None
            before = watch.threads_watched(proc.pid)
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "joined"
            await asyncio.wait_for(woke.wait(), WAIT_S)
            identity = process_identity(proc.pid)
            deadline = asyncio.get_running_loop().time() + WAIT_S
            while watch.threads_watched(proc.pid) != {proc.pid}:  # the workers' ends seen
                assert asyncio.get_running_loop().time() < deadline, \
                    f"still watching {watch.threads_watched(proc.pid)}"
                await asyncio.sleep(0.01)
                watch.follow([proc.pid])  # as every liveness tick does
            return identity, before, watch.threads_watched(proc.pid)

    identity, before, after = asyncio.run(scenario())
    assert identity is not None
    assert len(before) == THREADS_WATCHED
    assert after < before  # the workers are gone; the main thread is left


@pytest.mark.parametrize(("stat_flags", "sig_pending", "shared_pending", "ending"), [
    (0x400000, "0000000000000000", "0000000000000000", False),  # running
    (0x400004, "0000000000000000", "0000000000000000", True),  # main thread exiting
    (0x400200, "0000000000000000", "0000000000000000", True),  # dumping core
    (0x400000, "0000000000000100", "0000000000000000", True),  # SIGKILL on its threads
    (0x400000, "0000000000000000", "0000000000000100", True),  # SIGKILL to the process
    (0x400000, "0000000000004000", "0000000000000002", False),  # SIGTERM, SIGINT: handled
])
def test_a_process_reads_as_ending_once_killed_dumping_core_or_exiting(
        tmp_path: Path, stat_flags: int, sig_pending: str, shared_pending: str,
        ending: bool) -> None:
    # /proc as the kernel writes it for a live process, with its main thread's flags
    # (field 9) and pending signals; a command name with spaces and parentheses.
    (tmp_path / "4242").mkdir()
    fields = ["S", "1", "4242", "4242", "0", "-1", str(stat_flags)] + ["0"] * 12 + ["777"]
    (tmp_path / "4242" / "stat").write_text(f"4242 (a (b) c) {' '.join(fields)} 0 0\n")
    (tmp_path / "4242" / "status").write_text(
        f"Name:\ta\nState:\tS (sleeping)\nSigPnd:\t{sig_pending}\n"
        f"ShdPnd:\t{shared_pending}\nSigBlk:\t0000000000000000\n")
    identity = process_identity(4242, proc=tmp_path)
    assert (identity is None) is ending
    if not ending:
        assert identity == ProcessIdentity(4242, 777)
