"""Ranks register and heartbeat over the daemon's Unix socket; deaths are detected."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys

import grpc
import pytest
from fixtures_daemon import DaemonFactory, daemon_env, wait_for

from stalwart.client import daemon_client
from stalwart.client.daemon_client import DaemonClient
from stalwart.client.daemon_env import DaemonUnavailable, RankEnv, default_target
from stalwart.v1 import common_pb2, peer_pb2_grpc

TORCHRUN_ENV = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}

# A stand-in for a training process: registers, heartbeats, then waits to be killed.
FAKE_RANK = """
import sys
from stalwart.client.daemon_client import DaemonClient
client = DaemonClient(sys.argv[1])
print(client.register().rank_id, flush=True)
client.start_heartbeats()
sys.stdin.read()
"""


def code_of(err: DaemonUnavailable) -> grpc.StatusCode:
    return err.__cause__.code()  # type: ignore[union-attr]


def test_rank_registers_and_heartbeats_over_the_unix_socket(
        daemon_factory: DaemonFactory) -> None:
    d = daemon_factory.start("a")
    with DaemonClient(d.socket_target) as client:
        reply = client.register(env=TORCHRUN_ENV)
        assert reply.rank_id == f"a/{os.getpid()}" and reply.node == "a"
        assert (reply.generation, reply.heartbeat_interval_s) == (1, 1.0)
        client.report_step(12, 0.25)
        client.start_heartbeats()
        rank = wait_for(lambda: (r := d.rank(reply.rank_id)) and r.step == 12 and r, 10,
                        "the daemon to see step 12")
        assert (rank.rank, rank.pid, rank.state, rank.step_time_s) == (
            3, os.getpid(), "alive", 0.25)
        assert 0 <= rank.last_heartbeat_age_s < 5.0
        assert "stalwart_heartbeats_total" in d.metrics()
    # A clean close says goodbye: the rank left, and that is no failure.
    assert d.rank(reply.rank_id).state == "left"
    assert not d.status().recent_failures


def test_killed_rank_process_is_marked_dead(daemon_factory: DaemonFactory) -> None:
    # A heartbeat timeout far beyond the wait below: only the pid watch can see the death.
    d = daemon_factory.start("a", settings={"heartbeat_timeout_s": 120})
    rank = subprocess.Popen([sys.executable, "-c", FAKE_RANK, d.socket_target],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=daemon_env(TORCHRUN_ENV))
    try:
        rank_id = rank.stdout.readline().strip()
        assert rank_id == f"a/{rank.pid}"
        wait_for(lambda: d.rank(rank_id).state == "alive", 10, "the rank to be alive")
        rank.send_signal(signal.SIGKILL)
        wait_for(lambda: d.rank(rank_id).state == "dead", 20, "the daemon to mark it dead")
    finally:
        rank.kill()
        rank.wait(10)
    [failure] = d.status().recent_failures
    assert failure.kind == common_pb2.FailureEvent.PROCESS_EXIT and failure.subject == rank_id
    assert 'stalwart_failures_detected_total{kind="process_exit"} 1.0' in d.metrics()


def test_silent_rank_is_late_then_dead_and_then_fenced(daemon_factory: DaemonFactory) -> None:
    # Late after 0.4 s, dead after 3 s: a window wide enough to observe on a busy machine.
    d = daemon_factory.start("a", settings={"heartbeat_interval_s": 0.2,
                                            "heartbeat_timeout_s": 3.0})
    client = DaemonClient(d.socket_target)
    rank_id = client.register(env=TORCHRUN_ENV).rank_id  # and no heartbeats
    states = set()
    wait_for(lambda: states.add(d.rank(rank_id).state) or "dead" in states, 10,
             "the silent rank to be declared dead")
    assert "late" in states
    assert 'stalwart_failures_detected_total{kind="heartbeat_missed"} 1.0' in d.metrics()
    with pytest.raises(DaemonUnavailable, match="declared dead") as err:
        client.heartbeat()
    assert code_of(err.value) == grpc.StatusCode.FAILED_PRECONDITION
    client.register(env=TORCHRUN_ENV)  # rejoining is allowed
    client.heartbeat()
    client.close()


def test_heartbeat_of_an_older_generation_is_refused(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory.start("a")
    client = DaemonClient(d.socket_target)
    client.register(env=TORCHRUN_ENV)
    events = client.watch_plan()
    with grpc.insecure_channel(d.address) as channel:
        ack = peer_pb2_grpc.PeerServiceStub(channel).InstallPlan(
            common_pb2.Plan(generation=2, reason="spare replaces rank 1"), timeout=5,
            # As the coordinator would: this daemon (node "a") holding the job token.
            metadata=(*d.token_metadata, ("stalwart-node", "a")))
    assert ack.accepted, ack.message
    event = next(events)
    assert (event.plan.generation, event.plan.reason) == (2, "spare replaces rank 1")
    with pytest.raises(DaemonUnavailable, match="from generation 1, but the job is at "
                                                "generation 2") as err:
        client.heartbeat()
    assert code_of(err.value) == grpc.StatusCode.ABORTED
    client.generation = event.plan.generation
    assert client.heartbeat().generation == 2
    client.close()


def test_token_and_unknown_ranks_are_refused(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory.start("a", settings={"token": "s3cret"})
    with pytest.raises(DaemonUnavailable, match="wrong job token") as err:
        DaemonClient(d.socket_target, token="guess").register()
    assert code_of(err.value) == grpc.StatusCode.UNAUTHENTICATED
    client = DaemonClient(d.socket_target, token="s3cret")
    client.register()
    client.rank_id = "a/1"
    with pytest.raises(DaemonUnavailable, match="not registered") as err:
        client.heartbeat()
    assert code_of(err.value) == grpc.StatusCode.NOT_FOUND
    assert 'stalwart_auth_refused_total{reason="token"} 1.0' in d.metrics()


def _register_in_child(client: DaemonClient, results: multiprocessing.Queue) -> None:
    try:
        reply = client.register(env=TORCHRUN_ENV)
        client.heartbeat()
        results.put((os.getpid(), reply.rank_id))
    except Exception as e:  # the parent reports it
        results.put((os.getpid(), repr(e)))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_client_handed_to_another_process_opens_its_own_channel(
        daemon_factory: DaemonFactory, method: str) -> None:
    d = daemon_factory.start("a")
    client = DaemonClient(d.socket_target)
    parent_id = client.register(env=TORCHRUN_ENV).rank_id
    ctx = multiprocessing.get_context(method)
    results = ctx.Queue()
    child = ctx.Process(target=_register_in_child, args=(client, results))
    child.start()
    pid, child_id = results.get(timeout=60)
    child.join(30)
    assert child_id == f"a/{pid}" and pid != os.getpid()
    client.heartbeat()  # the parent's channel still works
    assert parent_id != child_id
    client.close()


def test_client_inherited_through_fork_opens_its_own_channel(
        daemon_factory: DaemonFactory) -> None:
    d = daemon_factory.start("a")
    client = DaemonClient(d.socket_target)
    parent_id = client.register(env=TORCHRUN_ENV).rank_id
    # Run the fork in a fresh interpreter: forking this multi-threaded test process is unsafe.
    code = f"""
import os, sys
from stalwart.client.daemon_client import DaemonClient
client = DaemonClient({d.socket_target!r})
client.register()
client.start_heartbeats()
child = os.fork()
if child == 0:
    rank_id = client.register().rank_id
    client.heartbeat()
    client.close()
    print("child", rank_id, flush=True)
    os._exit(0)
_, status = os.waitpid(child, 0)
client.heartbeat()
print("parent", client.rank_id, os.waitstatus_to_exitcode(status), flush=True)
client.close()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=daemon_env())
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    child_id, (parent2_id, child_exit) = lines["child"], lines["parent"].split()
    assert child_id != parent2_id and child_exit == "0"
    assert {r.rank_id for r in d.status().ranks} == {parent_id, parent2_id, child_id}
    client.close()


def test_torchrun_environment_is_read_with_single_process_defaults() -> None:
    assert RankEnv.from_environ({}) == RankEnv(0, 1, 0, "", 0)
    env = {**TORCHRUN_ENV, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert RankEnv.from_environ(env) == RankEnv(3, 4, 1, "10.0.0.1", 29500)
    with pytest.raises(ValueError, match=r"\$RANK must be an integer"):
        RankEnv.from_environ({"RANK": "zero"})


def test_default_target_follows_the_daemon_settings() -> None:
    assert default_target({}) == "unix:/var/lib/stalwart/daemon.sock"
    assert default_target({"STALWART_DATA_DIR": "/d"}) == "unix:/d/daemon.sock"
    assert default_target({"STALWART_DATA_DIR": "/d", "STALWART_UNIX_SOCKET": "/s.sock"}) == (
        "unix:/s.sock")
    assert default_target({"STALWART_ADDRESS": "h:7070", "STALWART_UNIX_SOCKET": "/s"}) == (
        "h:7070")


def test_local_daemon_is_one_client_per_process(daemon_factory: DaemonFactory,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    d = daemon_factory.start("a")
    monkeypatch.setenv("STALWART_UNIX_SOCKET", str(d.unix_socket))
    monkeypatch.setattr(daemon_client, "_shared", None)
    client = daemon_client.local_daemon()
    assert daemon_client.local_daemon() is client
    assert client.register(env=TORCHRUN_ENV).node == "a"
    client.close()


def test_a_rank_whose_layout_is_not_its_world_is_refused_with_what_to_fix(
        daemon_factory: DaemonFactory) -> None:
    # The first plan is made of the ranks' layout: one that does not make WORLD_SIZE
    # ranks is refused at registration, saying so, instead of failing the plan later.
    d = daemon_factory.start("a")
    client = DaemonClient(d.socket_target, token=d.token)
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    with pytest.raises(DaemonUnavailable, match=r"\(dp=unset pp=8 tp=1\) do not make a "
                                                r"world of 4 ranks") as err:
        client.register(env=env, layout=common_pb2.ParallelLayout(pp=8))
    assert code_of(err.value) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(DaemonUnavailable, match="do not make a world of 4") as err:
        client.register(env=env, layout=common_pb2.ParallelLayout(dp=2, pp=1))
    assert code_of(err.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert client.register(env=env, layout=common_pb2.ParallelLayout(dp=2, pp=2)).rank_id
    client.close()
