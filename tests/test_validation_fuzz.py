"""Hypothesis fuzzing of every RPC handler and of the manifest parser.

Each handler is called in-process (the servicer object a daemon serves) with random
messages built from the protobuf descriptors, biased to edge values: huge and negative
numbers, NaN, long strings, path traversal, deep repeats. A handler may answer or abort
with a status; anything else that escapes, or a call that does not end within its
deadline, is a failure. Memory use after thousands of calls must stay within a budget.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import pytest
from google.protobuf import descriptor as pbd
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart.core import manifest as mf
from stalwart.daemon.config import DaemonConfig, SnapshotConfig
from stalwart.daemon.rpc.peer_service import PeerServicer
from stalwart.daemon.rpc.rank_service import RankServicer
from stalwart.daemon.rpc.shard_service import ShardServicer
from stalwart.daemon.security.auth import Authenticator
from stalwart.daemon.server import Daemon
from stalwart.v1 import common_pb2, manifest_pb2, operator_pb2, peer_pb2, rank_pb2

FUZZ_TOKEN = "fuzz-token"
CREDENTIALS = (("stalwart-token", FUZZ_TOKEN), ("stalwart-node", "n1"))
CALL_DEADLINE_S = 5.0      # a handler that takes longer than this is hung
WAITING_CALLS = {"WatchPlan", "WaitCommitted"}  # may legitimately wait for news...
WAIT_S = 0.02              # ...so they are cut short after this long (seconds)
MEMORY_BUDGET_BYTES = 64 << 20  # resident memory growth allowed over the memory run
FD = pbd.FieldDescriptor

STRINGS = st.one_of(
    st.sampled_from(["", "default", "n1", "n1/1", "../../etc/passwd", "/etc/passwd", "..", ".",
                     "a/../../b", "x" * 5000, "\x00", "127.0.0.1:1", "stalwart-token",
                     "c0.0", "default/c0.0", "\u202e", "%2e%2e%2f"]),
    st.text(max_size=40))
INTS = {
    FD.TYPE_INT32: st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, -2**31]),
                             st.integers(-2**31, 2**31 - 1)),
    FD.TYPE_INT64: st.one_of(st.sampled_from([0, -1, 2**63 - 1, -2**63]),
                             st.integers(-2**63, 2**63 - 1)),
    FD.TYPE_UINT32: st.one_of(st.sampled_from([0, 1, 2**32 - 1]), st.integers(0, 2**32 - 1)),
    FD.TYPE_UINT64: st.one_of(st.sampled_from([0, 1, 2, 2**53, 2**63, 2**64 - 1, 10**12]),
                              st.integers(0, 2**64 - 1)),
}
FLOATS = st.one_of(st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf, 1e308]),
                   st.floats(allow_nan=True, allow_infinity=True))


def _scalar(field: pbd.FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in INTS:
        return INTS[t]
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return FLOATS if t == FD.TYPE_DOUBLE else st.floats(width=32)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_STRING:
        return STRINGS
    if t == FD.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\xff" * 4096]))
    if t == FD.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]),
                         st.integers(-5, 100))
    raise AssertionError(f"no strategy for field type {t}")


def messages(cls: type[Message], depth: int = 3) -> st.SearchStrategy[Message]:
    """Random instances of a protobuf message class, nested `depth` levels deep."""
    desc = cls.DESCRIPTOR

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        for field in desc.fields:
            if not draw(st.booleans()):
                continue
            is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
            if is_map:
                key_f = field.message_type.fields_by_name["key"]
                val_f = field.message_type.fields_by_name["value"]
                if val_f.message_type is not None:
                    continue
                for k, v in draw(st.dictionaries(_scalar(key_f), _scalar(val_f), max_size=3)
                                 ).items():
                    getattr(msg, field.name)[k] = v
            elif field.message_type is not None:
                if depth <= 0:
                    continue
                sub = messages(field.message_type._concrete_class, depth - 1)
                if field.is_repeated:
                    getattr(msg, field.name).extend(draw(st.lists(sub, max_size=3)))
                else:
                    getattr(msg, field.name).CopyFrom(draw(sub))
            elif field.is_repeated:
                getattr(msg, field.name).extend(draw(st.lists(_scalar(field), max_size=4)))
            else:
                setattr(msg, field.name, draw(_scalar(field)))
        return msg

    return build()


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class FakeContext:
    """Enough of grpc.aio.ServicerContext for the handlers: abort raises."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._metadata = metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        raise Aborted(code, details)

    def invocation_metadata(self):
        return self._metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5"

    def auth_context(self) -> dict:
        return {}

    async def write(self, message) -> None:
        pass

    def set_trailing_metadata(self, md) -> None:
        pass

    def set_code(self, code) -> None:
        pass

    def set_details(self, details) -> None:
        pass


async def _drain(result: Any, limit: int = 3) -> None:
    """Await a unary result or take a few items of a stream."""
    if hasattr(result, "__aiter__"):
        n = 0
        async for _ in result:
            n += 1
            if n >= limit:
                break
    else:
        await result


async def _request_stream(pieces: list[Message]):
    for p in pieces:
        yield p


class Harness:
    """One daemon's servicers, not serving on any socket, driven by one event loop."""

    def __init__(self, root: Path) -> None:
        self.loop = asyncio.new_event_loop()
        cfg = DaemonConfig(node="n1", listen="127.0.0.1:0", metrics_port=0,
                           data_dir=str(root / "d"), unix_socket=str(root / "d.sock"),
                           snapshot=SnapshotConfig(slot_bytes=8 << 20, chunk_bytes=8192))
        self.daemon = Daemon(cfg)
        d = self.daemon
        self.loop.run_until_complete(d.job.snapshots.start())
        auth = Authenticator(FUZZ_TOKEN, tls=False, metrics=d.metrics)
        self.servicers = {
            "RankService": RankServicer(cfg, d.registry, d.metrics, d.stopping, auth,
                                        snapshots=d.job.snapshots,
                                        on_register=d.job.announcer.on_register),
            "PeerService": PeerServicer(d.membership, d.registry, d.peer_info, auth,
                                        d.job.gate, d.job.leadership.leader, metrics=d.metrics,
                                        job_id=cfg.job_id),
            "OperatorService": d.operator,
            "ShardService": ShardServicer(root / "shards", d.metrics, auth=auth,
                                          quota=d.job.snapshots.quota, policy=d.job.gate),
        }

    def call(self, service: str, method: str, request: Any) -> str:
        handler = getattr(self.servicers[service], method)

        async def run() -> None:
            # Past authentication (a daemon of the job calling): the handlers' own checks.
            await _drain(handler(request, FakeContext(CREDENTIALS)))

        try:
            deadline = WAIT_S if method in WAITING_CALLS else CALL_DEADLINE_S
            self.loop.run_until_complete(asyncio.wait_for(run(), deadline))
        except Aborted as e:
            return e.code.name
        except TimeoutError:
            if method in WAITING_CALLS:
                return "WAITED"
            raise AssertionError(f"{service}.{method} hung on {request!r:.300}") from None
        return "OK"

    def close(self) -> None:
        self.daemon.stopping.set()
        self.loop.run_until_complete(self.daemon.job.snapshots.stop())
        self.loop.close()


# service, method, request class (a list = a client stream of those)
RPCS = [
    ("RankService", m.name, m.input_type._concrete_class)
    for m in rank_pb2.DESCRIPTOR.services_by_name["RankService"].methods
] + [
    ("PeerService", m.name, m.input_type._concrete_class)
    for m in peer_pb2.DESCRIPTOR.services_by_name["PeerService"].methods
] + [
    ("ShardService", m.name, m.input_type._concrete_class)
    for m in peer_pb2.DESCRIPTOR.services_by_name["ShardService"].methods
] + [
    ("OperatorService", m.name, m.input_type._concrete_class)
    for m in operator_pb2.DESCRIPTOR.services_by_name["OperatorService"].methods
]
# Methods that take a stream of requests (PutShard, StepStream): fuzzed with lists
CLIENT_STREAMS = {m.name for d, name in ((peer_pb2, "PeerService"), (peer_pb2, "ShardService"),
                                         (rank_pb2, "RankService"),
                                         (operator_pb2, "OperatorService"))
                  for m in d.DESCRIPTOR.services_by_name[name].methods if m.client_streaming}
EXAMPLES_PER_RPC = 60
MEMORY_CALLS = 1200


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory):
    h = Harness(Path(tmp_path_factory.mktemp("fuzz")))
    # A fuzzed plan could name any pid as a rank to fence: never send real signals.
    with mock.patch("stalwart.daemon.recovery.fencing.os"):
        yield h
    h.close()


def rss_bytes() -> int:
    """Resident set size of this process (bytes): Python heap, native buffers and slots."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_every_rpc_is_fuzzed() -> None:
    methods = {m for _, m, _ in RPCS}
    assert {"Register", "Capture", "Restore", "Gossip", "CommitStep", "PutShard",
            "GetShard", "Status", "StepStream"} <= methods
    assert {"PutShard", "StepStream"} <= CLIENT_STREAMS
    assert len(RPCS) >= 18


@pytest.mark.parametrize(("service", "method", "cls"), RPCS, ids=[f"{s}.{m}" for s, m, _ in RPCS])
def test_random_requests_never_crash_or_hang_a_handler(harness: Harness, service: str,
                                                       method: str, cls: type) -> None:
    client_stream = method in CLIENT_STREAMS
    strategy = st.lists(messages(cls), min_size=0, max_size=4) if client_stream else messages(cls)

    @settings(max_examples=EXAMPLES_PER_RPC, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=strategy)
    def check(request: Any) -> None:
        if client_stream:
            request = _request_stream(request)
        outcome = harness.call(service, method, request)
        assert outcome != "INTERNAL" or service == "ShardService"

    check()


def test_memory_stays_within_budget_over_thousands_of_random_requests(
        harness: Harness) -> None:
    import random
    rng = random.Random(7)
    with warnings.catch_warnings():  # .example() is fine for a fixed pool of samples
        warnings.simplefilter("ignore")
        samples = {cls: [messages(cls).example() for _ in range(10)] for _, _, cls in RPCS}
    def one_round(calls: int) -> None:
        for i in range(calls):
            service, method, cls = RPCS[i % len(RPCS)]
            request = rng.choice(samples[cls])
            if method in CLIENT_STREAMS:
                request = _request_stream([request])
            harness.call(service, method, request)
        gc.collect()

    one_round(len(RPCS) * 4)  # warm up: caches, thread pools, first slots
    before = rss_bytes()
    one_round(MEMORY_CALLS)
    grown = rss_bytes() - before
    assert grown < MEMORY_BUDGET_BYTES, f"resident memory grew by {grown} bytes"


def _valid_manifest() -> bytes:
    import tempfile

    from snapshot_states import state, tensors

    from stalwart.daemon.snapshot.local_store import LocalStore
    with tempfile.TemporaryDirectory() as d:
        store = LocalStore(Path(d), chunk_bytes=8192)
        coord = common_pb2.RankCoord(rank=0)
        prepared = store.encode(1, 0, state(1), tensors(), coord=coord)
        ranks = [store.prepare(1, prepared)]
        layout = common_pb2.ParallelLayout(dp=1, pp=1, tp=1)
        return mf.build_manifest(job_id="default", step=1, generation=1, layout=layout,
                                 ranks=ranks).SerializeToString()


VALID_MANIFEST = _valid_manifest()


@st.composite
def mutated_manifest(draw: st.DrawFn) -> bytes:
    """A valid manifest with a few bytes changed, cut or inserted."""
    data = bytearray(VALID_MANIFEST)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["set", "cut", "insert"]))
        byte = draw(st.integers(0, 255))
        if kind == "set":
            data[at] = byte
        elif kind == "cut":
            del data[at:at + draw(st.integers(1, 16))]
        else:
            data.insert(at, byte)
        if not data:
            break
    return bytes(data)


@settings(max_examples=1500, deadline=None, database=None)
@given(data=st.one_of(st.binary(max_size=512), mutated_manifest(),
                      messages(manifest_pb2.Manifest, depth=2).map(
                          lambda m: m.SerializeToString())))
def test_the_manifest_parser_refuses_garbage_with_a_manifest_error(data: bytes) -> None:
    try:
        manifest = manifest_pb2.Manifest.FromString(data)
    except DecodeError:
        return
    try:
        mf.validate(manifest)
        mf.verify_digest(manifest)
    except mf.ManifestError:
        return
    # Accepted: only bytes that still decode to the sealed manifest may be (a "set" that
    # wrote the byte already there, say); anything else slipped past the digest.
    assert manifest == manifest_pb2.Manifest.FromString(VALID_MANIFEST), manifest


def test_the_valid_manifest_passes_and_one_flipped_bit_of_it_is_refused() -> None:
    manifest = manifest_pb2.Manifest.FromString(VALID_MANIFEST)
    mf.validate(manifest)
    mf.verify_digest(manifest)
    manifest.step += 1
    with pytest.raises(mf.ManifestError):
        mf.validate(manifest)
        mf.verify_digest(manifest)


def test_fuzzing_calls_real_handlers(tmp_path: Path) -> None:
    fresh = Harness(tmp_path)  # the module's harness holds whatever the fuzzing left
    try:
        with mock.patch("stalwart.daemon.recovery.fencing.os"):
            ok = fresh.call("RankService", "Register",
                            rank_pb2.RegisterRequest(pid=os.getpid(), rank=0, world_size=1))
            bad = fresh.call("RankService", "Register", rank_pb2.RegisterRequest(pid=-5))
    finally:
        fresh.close()
    assert (ok, bad) == ("OK", "INVALID_ARGUMENT")
