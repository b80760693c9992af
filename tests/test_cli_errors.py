"""What a newcomer sees when a command cannot work: one line naming the flag and a value
that would, checked in the launcher before any rank starts; exit code 2 for a usage error,
no traceback unless `--debug`. The real `stalwart` command, run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def stalwart(*args: str, env: dict[str, str] | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_")}
    return subprocess.run([sys.executable, "-m", "stalwart.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**clean, **(env or {})})


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


@pytest.mark.parametrize(("flags", "words"), [
    (("--tp", "3"), ["--tp 3:", "do not split over tp=3", "(--tp 2 works)"]),
    (("--dp", "3"), ["global batch 16 does not split into dp=3", "(dp=2 would)"]),
    (("--dp", "0"), ["--dp/--pp/--tp:", "dp=0"]),
    (("--pp", "9"), ["pp=9: the model has 6 blocks"]),
    (("--pp", "2", "--bounds", "0-1,3-5"), ["must cover blocks 0..5", "e.g. 0-2,3-5"]),
    (("--pp", "2", "--bounds", "0-x"), ["--bounds '0-x'", "FIRST-LAST"]),
    (("--pp", "2", "--bounds", "0-5"), ["1 stage bounds for pp=2"]),
    (("--device", "cuda"), ["--device cuda: torch sees no CUDA device", "use --device cpu"]),
    (("--steps", "0"), ["--steps 0: must be at least 1"]),
])
def test_train_refuses_a_layout_that_cannot_work_before_any_rank_starts(flags, words) -> None:
    if "cuda" in flags:
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU: --device cuda is valid here")
    done = stalwart("train", "--steps", "2", *flags)
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("stalwart train: ")
    for w in words:
        assert w in line, (w, line)


def test_train_says_what_it_runs_and_warns_where_a_choice_is_slow(tmp_path) -> None:
    done = stalwart("train", "--steps", "2", "--model", "tiny", "--precision", "fp16",
                    "--recompute", "selective", "--log-every", "1")
    assert done.returncode == 0, done.stderr
    head = done.stderr.splitlines()[0]
    assert "precision fp16, recompute selective, device cpu" in head
    assert "note: precision fp16 on CPU: emulated" in done.stderr
    steps = [line.split()[1] for line in done.stderr.splitlines() if line.startswith("step ")]
    assert steps == ["1", "2"]  # counted from 1, as the demo counts
    done = stalwart("train", "--steps", "1", "--precision", "auto")
    assert done.returncode == 0 and "note: precision auto: bf16 on cpu" in done.stderr


def test_an_unforeseen_error_is_one_line_and_debug_shows_the_traceback(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A subcommand that fails in a way nobody foresaw (here: on purpose, as a module of
    # its own on the path, run by the real `stalwart` entry point).
    (tmp_path / "broken_cmd.py").write_text(
        "def configure(parser):\n    pass\n"
        "def run(args):\n    raise RuntimeError('shard 7\\nof step 3')\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import stalwart.cli as c; "
            "c.COMMANDS['broken'] = ('broken_cmd', 'fails'); sys.exit(c.main(sys.argv[2:]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_")}

    def broken(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code, str(tmp_path), *args],
                              capture_output=True, text=True, timeout=60, env=env)

    done = broken("broken")
    assert done.returncode == 1
    line = one_line(done)
    assert line.startswith("stalwart broken: RuntimeError: ") and "shard 7 of step 3" in line
    assert "--debug" in line
    debug = broken("--debug", "broken")
    assert debug.returncode == 1 and "Traceback" in debug.stderr


@pytest.mark.parametrize(("fault", "words"), [
    ("rank:9@step:3", ["--kill rank:9@step:3: the job has ranks 0..3", "rank:3@step:3"]),
    ("node:5@step:3", ["--kill node:5@step:3: the demo has nodes 0..1"]),
    ("rank:1@step:40", ["a fault fires after a step the run takes", "1..9 (--steps 10)"]),
    ("rank:1@commit:40", ["a fault fires after a step the run takes", "1..9 (--steps 10)"]),
])
def test_demo_refuses_a_fault_that_could_never_fire(fault, words) -> None:
    done = stalwart("demo", "--steps", "10", "--kill", fault)
    assert done.returncode == 2 and done.stdout == ""
    line = one_line(done)
    for w in words:
        assert w in line, (w, line)


def test_demo_says_how_a_fault_is_written() -> None:
    done = stalwart("demo", "--kill", "rank:1@commited:4")
    assert done.returncode == 2 and done.stdout == ""
    assert "@commit:S waits for step S to be committed" in done.stderr, done.stderr


MICRO = '{"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "seq_len": 16}'


@pytest.mark.multiprocess
def test_demo_stop_reads_as_a_stop_and_a_relative_workdir_is_kept(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "stalwart.cli", "demo", "--model-overrides", MICRO,
         "--nodes", "2", "--dp", "2", "--pp", "1", "--spares", "0", "--no-shrink",
         "--steps", "8", "--kill", "rank:1@step:3", "--collective-timeout", "4",
         "--workdir", "wd"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("STALWART_")})
    out = done.stdout
    assert done.returncode == 1, (out, done.stderr)
    assert f"logs and snapshots: {tmp_path / 'wd'}" in out and "removed at exit" not in out
    assert (tmp_path / "wd" / "node-0" / "daemon.log").exists()
    assert "STOP at committed step" in out and "NEW PLAN" not in out
    assert "None" not in out and "recovery from" not in out
    assert "training did NOT complete" in out and "param_digest" not in out
