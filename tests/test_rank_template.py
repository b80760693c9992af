"""The warm template a local cluster forks its ranks from: each rank runs its program as
a fresh `python` would (its argv, environment, log, exit status), with its own random
state, and no rank outlives the template's end."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.client.local_cluster import wait_until
from stalwart.client.rank_template import RankTemplate

PROGRAM = """
import os, random, sys, time
print("argv", sys.argv[1:], "env", os.environ["WHO"], "random", random.random(), flush=True)
while sys.argv[1:] == ["block"]:
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def template() -> Iterator[RankTemplate]:
    t = RankTemplate({**os.environ, "OMP_NUM_THREADS": "1"})
    yield t
    t.close()


def test_a_rank_runs_its_script_with_its_argv_env_and_log_and_reports_its_exit_code(
        template: RankTemplate, tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    procs = [template.spawn([str(script), str(code)], {**os.environ, "WHO": f"rank{code}"},
                            str(tmp_path / f"rank{code}.log")) for code in (0, 3)]
    assert [p.wait(timeout=60) for p in procs] == [0, 3]
    lines = [(tmp_path / f"rank{code}.log").read_text().split() for code in (0, 3)]
    assert lines[0][:4] == ["argv", "['0']", "env", "rank0"]
    assert lines[1][:4] == ["argv", "['3']", "env", "rank3"]
    assert lines[0][5] != lines[1][5]  # each fork reseeded `random` from the OS


def test_a_module_rank_fails_with_its_traceback_in_its_log(
        template: RankTemplate, tmp_path: Path) -> None:
    log = tmp_path / "m.log"
    proc = template.spawn(["-m", "stalwart.no_such_module"], dict(os.environ), str(log))
    assert proc.wait(timeout=60) == 1
    text = log.read_text()
    assert "Traceback" in text and "stalwart.no_such_module" in text, text


def test_a_killed_rank_reads_as_the_signal_that_ended_it(
        template: RankTemplate, tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    log = tmp_path / "b.log"
    proc = template.spawn([str(script), "block"], {**os.environ, "WHO": "b"}, str(log))
    wait_until(lambda: log.exists() and "argv" in log.read_text(), 60, "the rank to start")
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.kill()  # a no-op once it has ended: its pid may be someone else's by now


def test_closing_the_template_ends_every_rank_it_started(tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    log = tmp_path / "c.log"
    t = RankTemplate({**os.environ, "OMP_NUM_THREADS": "1"})
    proc = t.spawn([str(script), "block"], {**os.environ, "WHO": "c"}, str(log))
    wait_until(lambda: log.exists() and "argv" in log.read_text(), 60, "the rank to start")
    t.close()  # returns once the template has reaped the rank it killed: gone, no zombie
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
