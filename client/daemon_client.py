"""A training process's link to its node's daemon: register, heartbeat, report, close.

The gRPC channel is opened lazily by the process that uses it. A client
inherited through fork, or unpickled after spawn, notices the new pid and opens
its own channel; the parent's channel and heartbeat thread are never touched.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc

from stalwart.client.daemon_env import DaemonUnavailable, RankEnv, default_target, tls_credentials
from stalwart.client.job_token import find_token
from stalwart.client.shm import MappedSlot, SlotRefused
from stalwart.core.failures import RAISED_CHARS
from stalwart.daemon.config_schema import default
from stalwart.v1 import (
    common_pb2,
    manifest_pb2,
    operator_pb2,
    operator_pb2_grpc,
    rank_pb2,
    rank_pb2_grpc,
)

log = logging.getLogger("stalwart.client.daemon")

RestoredBytes = bytearray | mmap.mmap  # a restore's buffer, the caller's own

# A heartbeat refused with these codes will never be accepted: the rank must rejoin.
_FENCED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
FORK_PAUSE_S = 1.0  # longest a fork waits for an in-flight heartbeat (seconds)


_instance: tuple[int, str] = (0, "")


def process_instance() -> str:
    """This process's random name for the daemon (RegisterRequest.instance): drawn once
    per process, again in a fork, which inherits the parent's."""
    global _instance
    if _instance[0] != os.getpid():
        _instance = (os.getpid(), secrets.token_hex(8))
    return _instance[1]


# Every live client, so fork hooks can pause their heartbeats (see _before_fork).
_clients: weakref.WeakSet[DaemonClient] = weakref.WeakSet()


class DaemonClient:
    """Registers this process as a rank and keeps its heartbeat going in a background thread.

    Usage: ``with DaemonClient() as d: d.register(); d.start_heartbeats(); ...
    d.report_step(step, step_time_s)``. Thread-safe.
    """

    def __init__(self, target: str | None = None, *, job_id: str | None = None,
                 token: str | None = None, rpc_timeout_s: float = 5.0,
                 on_fenced: Callable[[str], None] | None = None) -> None:
        self.target = target or default_target()
        self.job_id = os.environ.get("STALWART_JOB_ID", "") if job_id is None else job_id
        self.token = find_token(self.target) if token is None else token
        self.rpc_timeout_s = rpc_timeout_s
        self.on_fenced = on_fenced  # called (from the heartbeat thread) when a rejoin is needed
        self._fresh_process_state()
        _clients.add(self)

    def _fresh_process_state(self) -> None:
        # New locks too: a fork may have copied them while another thread held them.
        self._lock = threading.Lock()
        self._beat_lock = threading.Lock()  # held by the heartbeat thread during its call
        self._paused_for_fork = False
        self._pid = os.getpid()
        self._channel: grpc.Channel | None = None
        self.rank_id = ""
        self.generation = 0
        self.heartbeat_interval_s: float = default("heartbeat_interval_s")  # until registered
        self.fenced = ""  # why the daemon refuses this rank's heartbeats, once it does
        self._step, self._step_time_s = 0, 0.0
        self._links_lock = threading.Lock()
        self._links: dict[tuple[str, str], float] = {}  # bytes sent, not yet reported
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # Spawned children get a copy of the settings, never of the channel or thread.
    def __getstate__(self) -> dict[str, Any]:
        return {"target": self.target, "job_id": self.job_id, "token": self.token,
                "rpc_timeout_s": self.rpc_timeout_s, "on_fenced": self.on_fenced}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def _ensure_process(self) -> grpc.Channel:
        with self._lock:
            if self._pid != os.getpid():
                # Inherited through fork: the parent's channel and thread are not ours to use.
                self._fresh_process_state()
            if self._channel is None:
                # A private subchannel pool: the global one would hand a forked child
                # the parent's connection, whose socket belongs to the parent.
                options = [("grpc.use_local_subchannel_pool", 1)]
                creds = tls_credentials()
                if creds is not None and not self.target.startswith("unix:"):
                    self._channel = grpc.secure_channel(self.target, creds, options=options)
                else:
                    self._channel = grpc.insecure_channel(self.target, options=options)
            return self._channel

    def _rank_stub(self) -> rank_pb2_grpc.RankServiceStub:
        return rank_pb2_grpc.RankServiceStub(self._ensure_process())

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        # The daemon checks the job token on every rank call, not only at Register.
        return (("stalwart-token", self.token),) if self.token else ()

    def _call(self, what: str, fn: Callable[..., Any], request: Any, **kwargs: Any) -> Any:
        try:
            return fn(request, timeout=kwargs.pop("timeout", self.rpc_timeout_s),
                      metadata=self._metadata(), **kwargs)
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
            detail = e.details()  # type: ignore[attr-defined]
            if code == grpc.StatusCode.UNAVAILABLE:
                detail = (f"no daemon answers at {self.target} ({detail}); start "
                          "`stalwart daemon` on this node or set STALWART_UNIX_SOCKET")
            raise DaemonUnavailable(f"{what} failed: {code.name}: {detail}") from e

    # rank lifecycle ------------------------------------------------------

    def register(self, *, spare: bool = False, device: str = "cpu",
                 env: Mapping[str, str] | None = None,
                 layout: common_pb2.ParallelLayout | None = None,
                 profile: common_pb2.LayerProfile | None = None,
                 store_port: int = 0, store_host: str = "") -> rank_pb2.RegisterReply:
        """Announce this process to the daemon with its torchrun RANK/WORLD_SIZE/LOCAL_RANK."""
        rank_env = RankEnv.from_environ(env)
        request = rank_pb2.RegisterRequest(
            job_id=self.job_id, pid=os.getpid(), rank=-1 if spare else rank_env.rank,
            world_size=rank_env.world_size, local_rank=rank_env.local_rank,
            hostname=socket.gethostname(), token=self.token, spare=spare, device=device,
            layout=layout, profile=profile, store_port=store_port, store_host=store_host,
            instance=process_instance())
        reply = self._call("register", self._rank_stub().Register, request)
        self.rank_id, self.generation = reply.rank_id, reply.generation
        self.heartbeat_interval_s = reply.heartbeat_interval_s or self.heartbeat_interval_s
        self.fenced = ""
        return reply

    def report_phases(self, phases: Mapping[str, float]) -> None:
        """Seconds this rank spent in recovery phases of its current generation
        (`rebuild`, `restore`); heartbeats carry them to the daemon's histograms."""
        self._phases = dict(phases)

    def report_step(self, step: int, step_time_s: float) -> None:
        """Set what the next heartbeat reports: the last completed step and its wall time (s)."""
        self._step, self._step_time_s = step, step_time_s

    def add_link_bytes(self, sent: Mapping[tuple[str, str], float]) -> None:
        """Bytes sent since the last call, {(link, collective): bytes}; the next heartbeat
        carries their sum to the daemon's stalwart_link_bytes_total."""
        with self._links_lock:
            for key, nbytes in sent.items():
                self._links[key] = self._links.get(key, 0.0) + nbytes

    def heartbeat(self, *, leaving: bool = False, raised: str = "",
                  finished_at: int = 0) -> rank_pb2.HeartbeatReply:
        """Send one heartbeat now (the background thread calls this every interval);
        `raised`: the exception this rank is about to exit with; `finished_at`: see
        `close`."""
        if not self.rank_id:
            raise DaemonUnavailable("heartbeat before register(): call register() first")
        with self._links_lock:
            links, self._links = self._links, {}
        request = rank_pb2.HeartbeatRequest(
            rank_id=self.rank_id, generation=self.generation, step=self._step,
            step_time_s=self._step_time_s, leaving=leaving, raised=raised[:RAISED_CHARS],
            finished_at=finished_at,
            recovery_phase_s=getattr(self, "_phases", {}),
            link_bytes=[rank_pb2.LinkBytesSent(link=link, collective=collective, bytes=n)
                        for (link, collective), n in links.items()])
        try:
            return self._call("heartbeat", self._rank_stub().Heartbeat, request)
        except DaemonUnavailable:
            self.add_link_bytes(links)  # not delivered: the next heartbeat carries them
            raise

    def start_heartbeats(self) -> None:
        """Heartbeat every interval the daemon asked for, in a daemon thread of this process."""
        self._ensure_process()
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat_forever, name="stalwart-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat_forever(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                with self._beat_lock:
                    self.heartbeat()
                failing = False
            except DaemonUnavailable as e:
                if e.code in _FENCED:
                    self.fenced = str(e)
                    log.error("daemon refuses this rank's heartbeats: %s", e)
                    if self.on_fenced is not None:
                        self.on_fenced(self.fenced)
                    return
                if not failing:  # log once per outage, not once per beat
                    log.warning("heartbeat failed, retrying: %s", e)
                failing = True
            self._stop.wait(self.heartbeat_interval_s)

    def stop_heartbeats(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._pid == os.getpid():
            self._thread.join(timeout_s)
        self._thread = None

    def close(self, *, leaving: bool = True, raised: str = "", finished_at: int = 0) -> None:
        """Stop heartbeats, tell the daemon this rank leaves cleanly (or, not leaving,
        the exception it exits with), close the channel. `finished_at`: the step its
        training loop ended at having trained the job's whole length (0: it did not)."""
        if self._pid != os.getpid():
            return  # nothing of this object belongs to this process
        self.stop_heartbeats()
        if (leaving or raised) and self.rank_id and not self.fenced:
            try:
                self.heartbeat(leaving=leaving, raised="" if leaving else raised,
                               finished_at=finished_at if leaving else 0)
            except DaemonUnavailable as e:
                log.warning("could not tell the daemon this rank %s: %s",
                            "leaves" if leaving else "raised", e)
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # fork safety: gRPC runs its fork handlers only when no thread is inside a call, and a
    # child forked in the middle of one can hang on its first RPC; so heartbeats pause.

    def _pause_for_fork(self) -> None:
        self._paused_for_fork = self._beat_lock.acquire(timeout=FORK_PAUSE_S)

    def _resume_after_fork(self) -> None:
        if self._paused_for_fork:
            self._paused_for_fork = False
            self._beat_lock.release()

    # other calls ---------------------------------------------------------

    def report_failure(self, kind: common_pb2.FailureEvent.Kind.ValueType, subject: str,
                       evidence: str, generation: int | None = None) -> common_pb2.Ack:
        """Report what a client-side detector saw (collective hang, GPU fault) in
        `generation` (default: the newest this client knows)."""
        event = common_pb2.FailureEvent(
            kind=kind, subject=subject, evidence=evidence, reporter=self.rank_id,
            generation=self.generation if generation is None else generation)
        return self._call("report_failure", self._rank_stub().ReportFailure, event)

    def call(self, what: str, method: str, request: Any, **kwargs: Any) -> Any:
        """Any RankService method by name, with this client's error handling."""
        return self._call(what, getattr(self._rank_stub(), method), request, **kwargs)

    def restore(self, step: int, rank: int, timeout_s: float = 300.0, *,
                into_slot: bool = True, layers: tuple[int, int] | None = None,
                on_call: Callable[[Any], None] | None = None
                ) -> tuple[manifest_pb2.RankState, RestoredBytes]:
        """A committed step's record and state bytes for `rank` (in that step's layout),
        in a buffer of the caller's own (`state_layout.unpack` copies each tensor out): a
        shared-memory slot the daemon filled, mapped here, or (`into_slot=False`, or
        where the daemon has no room for a slot or this process cannot map it) the bytes
        streamed over the socket. With `layers` (first, last), only the tensors of those
        layers and of no layer: the record lists just them, and only the chunks that
        hold them are read. `on_call` is handed the streaming call as it starts (for a
        caller on another thread to `cancel()`)."""
        request = rank_pb2.RestoreRequest(rank_id=self.rank_id, step=step, rank=rank,
                                          into_slot=into_slot)
        if layers is not None:
            request.layers.first, request.layers.last = layers
        state: manifest_pb2.RankState | None = None
        data = bytearray()
        slot, restored = ("", ""), step
        try:
            call = self._rank_stub().Restore(request, timeout=timeout_s,
                                             metadata=self._metadata())
            if on_call is not None:
                on_call(call)
            for piece in call:
                if piece.HasField("state"):
                    state, slot = piece.state, (piece.slot_id, piece.fd_socket)
                    restored = piece.step or step
                    if not piece.slot_id:
                        data = bytearray(state.total_bytes)
                else:
                    data[piece.offset:piece.offset + len(piece.data)] = piece.data
        except grpc.RpcError as e:
            raise DaemonUnavailable(f"restore of step {step} rank {rank} failed: "
                                    f"{e.code().name}: {e.details()}") from e  # type: ignore
        if state is None:
            raise DaemonUnavailable(f"restore of step {step} rank {rank}: empty reply")
        if not slot[0]:
            return state, data
        try:
            mapped = MappedSlot.attach(slot[1], slot[0], self.token)
        except (OSError, SlotRefused) as exc:
            log.warning("restore slot %s could not be mapped (%s); streaming the state",
                        slot[0], exc)
            return self.restore(restored, rank, timeout_s, into_slot=False, layers=layers,
                                on_call=on_call)
        return state, mapped.view  # the tensors viewing it keep the mapping alive

    def watch_plan(self, known_generation: int | None = None) -> Iterator[rank_pb2.PlanEvent]:
        """Plan changes as they happen (blocks between them; cancel by closing the client)."""
        known = self.generation if known_generation is None else known_generation
        request = rank_pb2.WatchPlanRequest(rank_id=self.rank_id, known_generation=known)
        yield from self._rank_stub().WatchPlan(request, metadata=self._metadata())

    def status(self) -> operator_pb2.StatusReply:
        """The daemon's view of the job (as `stalwart status` shows it)."""
        stub = operator_pb2_grpc.OperatorServiceStub(self._ensure_process())
        return self._call("status", stub.Status, operator_pb2.StatusRequest())


_shared: DaemonClient | None = None
_shared_lock = threading.Lock()


def local_daemon() -> DaemonClient:
    """This process's client of its node's daemon, made on first use (see default_target)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = DaemonClient()
        return _shared


def _before_fork() -> None:
    for client in list(_clients):
        client._pause_for_fork()


def _after_fork_in_parent() -> None:
    for client in list(_clients):
        client._resume_after_fork()


def _after_fork_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()
    for client in list(_clients):
        client._fresh_process_state()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
