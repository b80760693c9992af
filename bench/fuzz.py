"""`stalwart bench fuzz`: random, mutated and undecodable inputs to every RPC of a live daemon.

One daemon (in this process, on its real TCP port and Unix socket) takes N inputs
spread over every method of RankService, PeerService, ShardService and
OperatorService, each sent without credentials, with a rank's token, or as a daemon
(token and node), on both listeners. An input is random bytes, a random message
built from the protobuf descriptors (edge values: huge numbers, long strings, path
traversal), or a valid-looking message with a field changed. Figures: status codes
seen, crashes (UNKNOWN or INTERNAL answers, a daemon that stops answering), resident
memory growth (bytes) over the run. Pass: 0 crashes, 0 UNKNOWN.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from stalwart.bench.progress import say

INPUTS = 12_000
QUICK_INPUTS = 10_000
CALL_TIMEOUT_S = 2.0   # a handler slower than this counts as hung
WAITING = {"WatchPlan", "WaitCommitted"}  # may rightly wait: cut short, not hung
WAIT_TIMEOUT_S = 0.05
TOKEN = "fuzz-bench-token"
EDGE_STRINGS = ["", "default", "n1", "n1/1", "../../etc/passwd", "/etc/passwd", "..", "a//b",
                "x" * 5000, "\x00", "127.0.0.1:1", "c0.0", "\u202e", "%2e%2e%2f", "a" * 260]
EDGE_INTS = [0, 1, -1, 2, 2**31 - 1, -2**31, 2**53, 2**63 - 1, 2**64 - 1, 10**12]
CREDENTIALS = {
    "none": (),
    "rank token": (("stalwart-token", TOKEN),),
    "daemon n1": (("stalwart-token", TOKEN), ("stalwart-node", "n1")),
    "daemon n2": (("stalwart-token", TOKEN), ("stalwart-node", "n2")),
    "wrong token": (("stalwart-token", "guess"), ("stalwart-node", "n1")),
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _methods() -> list[tuple[str, Any]]:
    from stalwart.v1 import operator_pb2, peer_pb2, rank_pb2

    services = [rank_pb2.DESCRIPTOR.services_by_name["RankService"],
                peer_pb2.DESCRIPTOR.services_by_name["PeerService"],
                peer_pb2.DESCRIPTOR.services_by_name["ShardService"],
                operator_pb2.DESCRIPTOR.services_by_name["OperatorService"]]
    return [(s.full_name, m) for s in services for m in s.methods]


def _value(field: Any, rng: random.Random, depth: int) -> Any:
    from google.protobuf.descriptor import FieldDescriptor as FD

    t = field.type
    if t == FD.TYPE_MESSAGE:
        return _message(field.message_type._concrete_class, rng, depth - 1)
    if t == FD.TYPE_STRING:
        return rng.choice(EDGE_STRINGS) if rng.random() < 0.7 else "".join(
            chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(12)))
    if t == FD.TYPE_BYTES:
        return os.urandom(rng.randrange(64))
    if t == FD.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return rng.choice([0.0, -1.0, float("nan"), float("inf"), 1e30, rng.random()])
    if t == FD.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [99])
    bits = {FD.TYPE_INT32: 31, FD.TYPE_INT64: 63, FD.TYPE_UINT32: 32, FD.TYPE_UINT64: 64}
    width = bits.get(t, 31)
    signed = t in (FD.TYPE_INT32, FD.TYPE_INT64)
    lo, hi = (-(2**width), 2**width - 1) if signed else (0, 2**width - 1)
    pick = rng.choice(EDGE_INTS) if rng.random() < 0.6 else rng.randrange(0, 1000)
    return min(max(pick, lo), hi)


def _message(cls: Any, rng: random.Random, depth: int = 3) -> Any:
    msg = cls()
    if depth <= 0:
        return msg
    for field in cls.DESCRIPTOR.fields:
        if rng.random() < 0.5:
            continue
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            target = getattr(msg, field.name)
            key_f, val_f = entry.fields_by_name["key"], entry.fields_by_name["value"]
            if val_f.message_type is None:
                for _ in range(rng.randrange(3)):
                    target[_value(key_f, rng, depth)] = _value(val_f, rng, depth)
            continue
        if field.is_repeated:
            items = [_value(field, rng, depth) for _ in range(rng.randrange(4))]
            if field.message_type is not None:
                getattr(msg, field.name).extend(items)
            else:
                getattr(msg, field.name).extend(items)
        elif field.message_type is not None:
            getattr(msg, field.name).CopyFrom(_value(field, rng, depth))
        else:
            setattr(msg, field.name, _value(field, rng, depth))
    return msg


def _payload(method: Any, rng: random.Random) -> bytes:
    """One input for `method`: random bytes, a random message, or a mutated one."""
    kind = rng.random()
    if kind < 0.15:
        return os.urandom(rng.randrange(1, 200))
    data = bytearray(_message(method.input_type._concrete_class, rng).SerializeToString())
    if kind < 0.35 and data:
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data))
            data[at] = rng.randrange(256)
    return bytes(data)


# The details of an INTERNAL status the client library makes up itself (the daemon's own
# INTERNAL, from daemon/rpc/guard.py, names the method and the error).
CLIENT_CORE_ERROR = "Internal error from Core"


async def _one(channel: Any, service: str, method: Any, payload: bytes,
               metadata: tuple, rng: random.Random) -> str:
    import grpc

    name = f"/{service}/{method.name}"
    kind = ("stream_" if method.client_streaming else "unary_") + (
        "stream" if method.server_streaming else "unary")
    timeout = WAIT_TIMEOUT_S if method.name in WAITING else CALL_TIMEOUT_S
    fn = getattr(channel, kind)(name)
    try:
        if method.client_streaming:
            pieces = [payload, *(os.urandom(rng.randrange(32)) for _ in range(rng.randrange(3)))]

            async def stream():
                for p in pieces:
                    yield p
            call = fn(stream(), metadata=metadata, timeout=timeout)
        else:
            call = fn(payload, metadata=metadata, timeout=timeout)
        if method.server_streaming:
            for _ in range(3):
                if await call.read() is grpc.aio.EOF:
                    break
            call.cancel()
        else:
            await call
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and method.name not in WAITING:
            return "HUNG"
        if e.code() == grpc.StatusCode.INTERNAL and e.details() == CLIENT_CORE_ERROR:
            # Made by this client's own gRPC core, not sent by the daemon: a streaming
            # call whose answer (a refusal) came while this side was still sending.
            return "CLIENT_CORE"
        return e.code().name
    return "OK"


async def _fuzz(n: int, root: Path, seed: int) -> dict:
    import grpc

    from stalwart.daemon.config import DaemonConfig, SnapshotConfig
    from stalwart.daemon.server import Daemon

    cfg = DaemonConfig(node="n1", listen="127.0.0.1:0", metrics_port=0, data_dir=str(root),
                       unix_socket=str(root / "d.sock"), heartbeat_interval_s=0.2,
                       heartbeat_timeout_s=60.0, token=TOKEN,
                       snapshot=SnapshotConfig(chunk_bytes=8192, slot_bytes=8 << 20))
    daemon = Daemon(cfg)
    await daemon.start()
    rng = random.Random(seed)
    methods = _methods()
    codes: collections.Counter[str] = collections.Counter()
    by_method: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    started = time.perf_counter()
    try:
        async with grpc.aio.insecure_channel(daemon.address) as tcp, \
                grpc.aio.insecure_channel(f"unix:{daemon.unix_socket}") as unix:
            warm = n // 10
            rss_before = 0
            for i in range(n):
                if i and i % max(1, n // 10) == 0:
                    say(f"{i}/{n} inputs sent; {sum(codes.values()) - codes.get('OK', 0)} "
                        "refused so far")
                if i == warm:
                    gc.collect()
                    rss_before = _rss_bytes()
                service, method = methods[i % len(methods)]
                creds = rng.choice(list(CREDENTIALS))
                channel = unix if rng.random() < 0.25 else tcp
                code = await _one(channel, service, method, _payload(method, rng),
                                  CREDENTIALS[creds], rng)
                codes[code] += 1
                by_method[f"{service.rsplit('.', 1)[1]}.{method.name}"][code] += 1
            gc.collect()
            grown = _rss_bytes() - rss_before
            alive = await _one(tcp, "stalwart.v1.OperatorService", methods[-1][1], b"", (), rng)
    finally:
        await daemon.stop(grace_s=0)
    crashes = codes["UNKNOWN"] + codes["INTERNAL"] + codes["HUNG"] + (alive != "OK")
    return {
        "inputs": n, "seconds": round(time.perf_counter() - started, 2),
        "rpcs": len(methods), "credential_modes": list(CREDENTIALS),
        "codes": dict(sorted(codes.items())), "crashes": crashes,
        "unknown": codes["UNKNOWN"], "internal": codes["INTERNAL"], "hung": codes["HUNG"],
        "daemon_alive_after": alive == "OK",
        "rss_growth_bytes": grown, "rss_after_bytes": _rss_bytes(),
        "by_method": {k: dict(v) for k, v in sorted(by_method.items())},
    }


def run(quick: bool = False, n: int | None = None, seed: int = 19) -> dict:
    """Fuzz a live daemon with `n` inputs (default 12,000; 10,000 with `quick`)."""
    root = Path(tempfile.mkdtemp(prefix="stw-fuzz-", dir="/tmp"))
    old = os.umask(0)
    os.umask(old)  # the daemon tightens this process's umask; give it back afterwards
    quiet = logging.getLogger("stalwart")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # refusals and fuzzed failures would flood the log
    try:
        return asyncio.run(_fuzz(n or (QUICK_INPUTS if quick else INPUTS), root, seed))
    finally:
        quiet.setLevel(level)
        os.umask(old)
        shutil.rmtree(root, ignore_errors=True)
