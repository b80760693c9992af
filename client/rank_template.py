"""Rank processes of a local cluster forked from a warm template.

A fresh Python process spends about 4 s of CPU importing torch, torch.distributed and
the torch._dynamo that an optimizer's first parameter group pulls in; on a 2-core
machine that runs six ranks, their start costs more than their training. The template
is one child process that has done those imports and nothing else (no thread of its
own, no gRPC, no tensor op): each rank is a fork of it that takes its environment, log
and command line and runs the program as `python -m MODULE` or `python SCRIPT` would.

What a fork shares with its template, a fresh process would not: the interpreter's
string-hash seed (so a set of strings iterates in one order on every rank; the launcher,
which starts each rank cold, keeps that covered) and the state of `random` and of
numpy's global generator, which each child reseeds from the OS.

The protocol is one JSON object a line on the template's stdin and stdout, between a
process and its own child (no network, no pickle): `{"argv", "env", "log", "cwd"}` asks
for a rank, `{"pid"}` answers, and `{"exited", "code"}` reports each rank's end (its
exit status, or minus the signal that ended it, as `Popen.returncode` has it). When its
stdin closes, the template SIGKILLs every rank it started, reaps them and exits.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
from typing import Any

__all__ = ["RankTemplate", "TemplateProc"]

_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "numpy")


class TemplateProc:
    """A rank forked by the template, with the part of `subprocess.Popen` a cluster uses:
    `pid`, `returncode`, `poll()`, `wait(timeout)`, `send_signal()`, `kill()`."""

    def __init__(self, template: RankTemplate, pid: int) -> None:
        self._template = template
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self._template.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._template.ended:
            if not self._template.ended.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
        code = self.returncode
        assert code is not None
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # once reaped, the pid may be another process's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class RankTemplate:
    """The warm template process; `spawn` forks a rank from it."""

    def __init__(self, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "stalwart.client.rank_template"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                      text=True, bufsize=1)
        self._codes: dict[int, int] = {}
        self._forked: queue.Queue[int] = queue.Queue()  # each fork's pid; -1: template gone
        self.ended = threading.Condition()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="stalwart-rank-template",
                                        daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            if "pid" in msg:
                self._forked.put(msg["pid"])
                continue
            with self.ended:
                self._codes[msg["exited"]] = msg["code"]
                self.ended.notify_all()
        self._forked.put(-1)  # the template is gone: no fork will be answered

    def exit_code(self, pid: int) -> int | None:
        with self.ended:
            return self._codes.get(pid)

    def spawn(self, argv: list[str], env: dict[str, str], log: str, timeout_s: float = 60.0
              ) -> TemplateProc:
        """Fork a rank running `python *argv` with `env`, its output appended to `log`."""
        with self._lock:  # one request in flight: the next pid answers it
            assert self._proc.stdin is not None
            request = {"argv": argv, "env": env, "log": log, "cwd": os.getcwd()}
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
            except BrokenPipeError as e:
                raise RuntimeError("the rank template process has exited") from e
            try:
                pid = self._forked.get(timeout=timeout_s)
            except queue.Empty:
                raise RuntimeError(f"the rank template forked no rank in {timeout_s:g} s"
                                   ) from None
        if pid < 0:
            raise RuntimeError("the rank template process has exited")
        return TemplateProc(self, pid)

    def close(self) -> None:
        """End the template; it SIGKILLs every rank it started that still runs."""
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=10)


# The template process -------------------------------------------------------------------


def _run_child(request: dict[str, Any], inherited: list[int]) -> None:
    """In the forked child: become the rank the request describes; never returns.
    `inherited`: the template's own descriptors, closed here."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # replaces the template's stdin and stdout: the rank holds
        os.dup2(log, 1)   # no end of the pipes to the cluster
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own stdio)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace",  # noqa: SIM115
                          closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:  # as a fresh interpreter would have it
                sys.path.insert(1, entry)
        os.chdir(request["cwd"])
        import random
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        import runpy
        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve() -> None:
    for name in _PRELOAD:
        __import__(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    out = sys.stdout
    live: set[int] = set()
    buffered = b""
    stdin = sys.stdin.fileno()

    def reap() -> None:
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            live.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            out.write(json.dumps({"exited": pid, "code": code}) + "\n")
            out.flush()

    while True:
        try:
            ready, _, _ = select.select([stdin, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
            reap()
        if stdin not in ready:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:  # the cluster is gone: so are its ranks, reaped before the end
            for pid in live:
                os.kill(pid, signal.SIGKILL)
            for pid in live:
                os.waitpid(pid, 0)
            return
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            out.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(request, [wake_r, wake_w])
            live.add(pid)
            out.write(json.dumps({"pid": pid}) + "\n")
            out.flush()


if __name__ == "__main__":
    _serve()
