"""Every configuration key of the daemon, declared once: type, default, check, meaning.

The dataclasses of `daemon/config.py`, the flags' help, the clients' socket lookup
and the reference table in docs/operations.md (scripts/gen_config_docs.py) all read
it from here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_PREFIX = "STALWART_"
# sun_path of sockaddr_un is 108 bytes including the terminating NUL.
MAX_UNIX_SOCKET_PATH = 107
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
SOCKET_NAME = "daemon.sock"  # the Unix socket in data_dir when unix_socket is unset
KIND_NAMES = {"str": "a string", "int": "an integer", "float": "a number",
              "list": "a list of strings", "bool": "true or false"}


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; str() is one line."""


@dataclass(frozen=True)
class Key:
    """One configuration key: its kind ('str', 'int', 'float', 'bool', 'list'), default,
    check and meaning. `shown` is how the default reads where it is filled in at start-up
    (an empty `node` becomes the hostname)."""

    kind: str
    default: Any
    check: Callable[[Any], str | None] | None = None
    doc: str = ""
    shown: str = ""


def _in(*choices: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def _at_least(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be >= {low:g}"


def _port(v: int) -> str | None:
    return None if 0 <= v <= 65535 else "must be a port number 0-65535"


def _host_port(v: str) -> str | None:
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return "must be HOST:PORT, e.g. 127.0.0.1:7070"
    return None


def _optional_host_port(v: str) -> str | None:
    return _host_port(v) if v else None


def _host_ports(v: list[str]) -> str | None:
    for item in v:
        if _host_port(item):
            return f"entry {item!r} must be HOST:PORT, e.g. node2:7070"
    return None


def check_socket_path(v: str) -> str | None:
    if len(os.fsencode(v)) > MAX_UNIX_SOCKET_PATH:
        return f"is longer than the Unix socket limit of {MAX_UNIX_SOCKET_PATH} bytes; shorten it"
    return None


GiB = 1 << 30

SCHEMA: dict[str, dict[str, Key]] = {
    "": {
        "node": Key("str", "", doc="name of this node in step records and placement",
                    shown="the hostname"),
        "job_id": Key("str", "default", doc="job served; ranks of another job are refused"),
        "listen": Key("str", "127.0.0.1:7070", _host_port, "gRPC endpoint for peers and "
                      "operators, HOST:PORT; port 0 = any free port"),
        "unix_socket": Key("str", "", check_socket_path, "path of the Unix socket for the ranks of "
                           "this node", shown=f"{SOCKET_NAME} in data_dir"),
        "data_dir": Key("str", "/var/lib/stalwart", doc="directory of the daemon's state: "
                        "shards, records, the job token"),
        "metrics_port": Key("int", 9400, _port, "port of the Prometheus /metrics endpoint, "
                            "on the host of listen; 0 = off"),
        "log_format": Key("str", "", _in("json", "text"), "format of the logs on stderr: "
                          "json or text", shown="json unless stderr is a terminal"),
        "log_level": Key("str", "INFO", _in(*LOG_LEVELS),
                         "least severe log level written: " + ", ".join(LOG_LEVELS)),
        "peers": Key("list", [], _host_ports, "peer daemons as HOST:PORT"),
        "heartbeat_interval_s": Key("float", 1.0, _at_least(0.01),
                                    "rank heartbeat period (seconds)"),
        "heartbeat_timeout_s": Key("float", 5.0, _at_least(0.02), "a rank silent for this "
                                   "long is declared dead (seconds, > heartbeat_interval_s)"),
        "token": Key("str", "", doc="the job token for ranks, tools and (without TLS) peers; "
                     "empty = a per-job secret made in `<data_dir>/job.token`, which only this "
                     "daemon knows, so daemons of one job talking without TLS need the same "
                     "`token` (docs/security.md)"),
        "etcd": Key("str", "", _optional_host_port,
                    "HOST:PORT of etcd, where the daemons elect their coordinator; empty = the "
                    "smallest live node name coordinates"),
        "etcd_lease_s": Key("int", 3, _at_least(2), "lease of the coordinator's etcd key: a "
                            "dead coordinator is replaced within about this (seconds)"),
        "gossip_fanout": Key("int", 32, _at_least(0), "peers a daemon gossips with per "
                             "heartbeat interval once the job has more: its ring neighbours "
                             "(judged by age) and a random sample (their state comes second "
                             "hand), 0 = every peer every interval"),
        "commit_fanout": Key("int", 16, _at_least(0), "daemons each daemon passes a step's "
                             "commit on to (a tree of the job's daemons, so the coordinator "
                             "sends a step's record to this many), 0 = the coordinator "
                             "sends it to every daemon itself"),
    },
    "labels": {
        "rack": Key("str", "", doc="rack of this node: the shards of a chunk go to distinct "
                    "racks where they can"),
        "zone": Key("str", "", doc="zone of this node: the shards of a chunk go to distinct "
                    "zones where they can"),
    },
    "erasure": {
        "k": Key("int", 2, _at_least(1), "data shards per chunk"),
        "m": Key("int", 1, _at_least(0), "parity shards per chunk: a step survives the loss "
                 "of m nodes"),
        "parity_to": Key("str", "peers", _in("peers", "s3", "both"),
                         "where parity shards go: peers, s3 or both"),
        "encode_threads": Key("int", 2, _at_least(1), "threads that encode a capture's "
                              "chunks side by side (zfec releases the GIL)"),
    },
    "elastic": {
        "shrink": Key("bool", True, doc="without a spare, continue on the survivors with a "
                      "new plan (false: stop)"),
        "mem_cap_bytes": Key("int", 0, _at_least(0), "memory per device a new plan must fit "
                             "in (bytes), 0 = not checked"),
        "grow_threshold": Key("float", 0.1, _at_least(0.0), "widen the plan for a joining "
                              "rank when the predicted speed-up is at least this fraction"),
        "resume_settle_s": Key("float", 10.0, _at_least(0.0), "a stopped job that ranks "
                               "registering could resume only smaller waits until none "
                               "has registered for this long (seconds), so that a "
                               "relaunch's ranks resume it at full size together; one "
                               "that fills every lost role resumes at once"),
    },
    "snapshot": {
        "base_every": Key("int", 10, _at_least(1), "a full base every this many steps, "
                          "deltas in between"),
        "retain": Key("int", 5, _at_least(1), "committed steps kept"),
        "chunk_bytes": Key("int", 4 * 1024 * 1024, _at_least(4096),
                           "chunk size, the unit of checksums and erasure coding (bytes)"),
        "slot_bytes": Key("int", 8 * GiB, _at_least(1), "shared memory for the capture slots "
                          "of all ranks of this node, two per rank (bytes)"),
        "ram_tier_bytes": Key("int", 1 * GiB, _at_least(0), "daemon memory that caches "
                              "encoded chunks of recent steps for restores (bytes), "
                              "0 = every restore reads the disk or k shards"),
        "local_copy": Key("bool", False, doc="also keep every erasure-coded chunk whole on "
                          "the disk of the daemon that captured it: a restore after that "
                          "daemon restarts reads its disk instead of k shards, for 1 + "
                          "(k+m)/k times the encoded state stored instead of (k+m)/k; "
                          "chunks with no shards (one daemon, m = 0) are always kept whole"),
        "disk_quota_bytes": Key("int", 0, _at_least(0), "most bytes the local tier "
                                "(snapshots and peers' shards) may hold, 0 = no limit"),
        "disk_full_replan_s": Key("float", 60.0, _at_least(0.0), "seconds this node's "
                                  "disk (full, or over disk_quota_bytes) may refuse its "
                                  "ranks' captures before they count as failed: their roles "
                                  "go to spares on other nodes, or the job shrinks, so that "
                                  "steps commit again; 0 = never (the job trains on, "
                                  "unprotected, until space is freed)"),
        "disk_sync": Key("str", "background", _in("background", "write"),
                         "when stored files reach the disk: 'background' (a step counts "
                         "as stored once written on the nodes that keep it, which survives "
                         "any process crash and the loss of m nodes, power included; the "
                         "daemon writes its files back every disk_sync_every_s, and a power "
                         "loss of more than m nodes at once costs the steps since) or "
                         "'write' (every file is fsynced before its step counts as stored: "
                         "a step survives a power loss of every node, at several fsyncs "
                         "per shard on the commit path)"),
        "disk_sync_every_s": Key("float", 5.0, _at_least(0.1), "with disk_sync = "
                                 "'background': seconds between write-backs of the daemon's "
                                 "files to its disk"),
    },
    "s3": {
        "endpoint": Key("str", "", doc="S3 endpoint URL; empty = AWS's endpoint for the "
                        "region"),
        "bucket": Key("str", "", doc="bucket of the remote tier; empty = no remote tier"),
        "prefix": Key("str", "stalwart", doc="key prefix in the bucket"),
        "region": Key("str", "", doc="S3 region"),
    },
    "tls": {
        "cert": Key("str", "", doc="PEM certificate of this daemon; turns on mutual TLS"),
        "key": Key("str", "", doc="PEM private key of tls.cert"),
        "ca": Key("str", "", doc="PEM CA that signs every daemon and operator of the cluster"),
    },
}

# Keys that are gone: naming one stops the daemon with a line on what replaced it.
RENAMED = {
    "snapshot.ram_bytes": "was split in two: write snapshot.slot_bytes for the shared memory "
                          "of the ranks' capture slots (ram_bytes = 0 meant 8 GiB) and "
                          "snapshot.ram_tier_bytes for the daemon's cache of encoded chunks",
}


def default(dotted: str) -> Any:
    """The declared default of one key, e.g. default("snapshot.slot_bytes")."""
    section, _, key = dotted.rpartition(".")
    return SCHEMA[section][key].default


def shown_default(dotted: str) -> str:
    """The default of one key as the documentation and --help write it."""
    section, _, key = dotted.rpartition(".")
    spec = SCHEMA[section][key]
    if spec.shown:
        return spec.shown
    if spec.kind == "str":
        return f'"{spec.default}"'
    if spec.kind == "bool":
        return str(spec.default).lower()
    if spec.kind == "int" and spec.default and spec.default % (1 << 20) == 0:
        unit, size = ("GiB", GiB) if spec.default % GiB == 0 else ("MiB", 1 << 20)
        return f"{spec.default} ({spec.default // size} {unit})"
    return str(spec.default)


def socket_in(data_dir: str | Path) -> str:
    """The Unix socket a daemon serves when `unix_socket` is unset: <data_dir>/daemon.sock."""
    return str(Path(data_dir) / SOCKET_NAME)


# How daemon_socket() finds the socket, for --help texts.
SOCKET_LOOKUP = (f"$STALWART_UNIX_SOCKET, else <$STALWART_DATA_DIR or "
                 f"{default('data_dir')}>/{SOCKET_NAME}")


def daemon_socket(env: Mapping[str, str] | None = None) -> str:
    """This node's daemon socket as ranks and tools find it without a flag:
    $STALWART_UNIX_SOCKET, else the daemon's default for $STALWART_DATA_DIR or, unset,
    for the default data_dir."""
    env = os.environ if env is None else env
    if env.get("STALWART_UNIX_SOCKET"):
        return env["STALWART_UNIX_SOCKET"]
    return socket_in(env.get("STALWART_DATA_DIR") or default("data_dir"))
