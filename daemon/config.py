"""Daemon configuration: a TOML file, then STALWART_* environment variables, then flags.

Every key is declared once in SCHEMA with its type, default and check, so an
unknown key or a bad value fails at start-up with one line naming the key.
"""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_PREFIX = "STALWART_"
# sun_path of sockaddr_un is 108 bytes including the terminating NUL.
MAX_UNIX_SOCKET_PATH = 107
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; str() is one line."""


@dataclass(frozen=True)
class Key:
    """One configuration key: its kind ('str', 'int', 'float', 'list'), default and check."""

    kind: str
    default: Any
    check: Callable[[Any], str | None] | None = None
    allowed: str = ""  # shown in errors: what the user may write


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


def _socket_path(v: str) -> str | None:
    if len(os.fsencode(v)) > MAX_UNIX_SOCKET_PATH:
        return f"is longer than the Unix socket limit of {MAX_UNIX_SOCKET_PATH} bytes; shorten it"
    return None


SCHEMA: dict[str, dict[str, Key]] = {
    "": {
        "node": Key("str", "", allowed="a node name (default: the hostname)"),
        "job_id": Key("str", "default"),
        "listen": Key("str", "127.0.0.1:7070", _host_port),
        "unix_socket": Key("str", "", _socket_path, "a path (default: <data_dir>/daemon.sock)"),
        "data_dir": Key("str", "/var/lib/stalwart"),
        "metrics_port": Key("int", 9400, _port, "a port number, 0 = off"),
        "log_format": Key("str", "", _in("json", "text")),
        "log_level": Key("str", "INFO", _in(*LOG_LEVELS)),
        "peers": Key("list", [], _host_ports, "a list of HOST:PORT"),
        "heartbeat_interval_s": Key("float", 1.0, _at_least(0.01)),
        "heartbeat_timeout_s": Key("float", 5.0, _at_least(0.02)),
        "token": Key("str", ""),
        "etcd": Key("str", "", _optional_host_port,
                    "HOST:PORT of etcd to elect the coordinator (default: the smallest "
                    "live node name coordinates)"),
        "etcd_lease_s": Key("int", 3, _at_least(2)),
    },
    "labels": {"rack": Key("str", ""), "zone": Key("str", "")},
    "erasure": {
        "k": Key("int", 2, _at_least(1)),
        "m": Key("int", 1, _at_least(0)),
        "parity_to": Key("str", "peers", _in("peers", "s3", "both")),
    },
    "elastic": {
        "shrink": Key("bool", True),
        "mem_cap_bytes": Key("int", 0, _at_least(0), "bytes per device, 0 = not checked"),
        "grow_threshold": Key("float", 0.1, _at_least(0.0), "fraction of speed-up"),
    },
    "snapshot": {
        "base_every": Key("int", 10, _at_least(1)),
        "retain": Key("int", 5, _at_least(1)),
        "chunk_bytes": Key("int", 4 * 1024 * 1024, _at_least(4096)),
        "ram_bytes": Key("int", 0, _at_least(0), "bytes, 0 = no limit"),
        "disk_quota_bytes": Key("int", 0, _at_least(0), "bytes, 0 = no limit"),
    },
    "s3": {
        "endpoint": Key("str", ""),
        "bucket": Key("str", ""),
        "prefix": Key("str", "stalwart"),
        "region": Key("str", ""),
    },
    "tls": {"cert": Key("str", ""), "key": Key("str", ""), "ca": Key("str", "")},
}


@dataclass(frozen=True)
class Labels:
    rack: str = ""
    zone: str = ""


@dataclass(frozen=True)
class ElasticSettings:
    shrink: bool = True
    """Without a spare, continue on the survivors with a new plan (else stop)."""
    mem_cap_bytes: int = 0
    """Memory per device a new plan must fit in (bytes); 0 = not checked."""
    grow_threshold: float = 0.1
    """Widen the plan for a joining rank when the predicted speed-up is at least this."""


@dataclass(frozen=True)
class ErasureConfig:
    k: int = 2
    """Data shards per chunk."""
    m: int = 1
    """Parity shards per chunk: a step survives the loss of m nodes."""
    parity_to: str = "peers"


@dataclass(frozen=True)
class SnapshotConfig:
    base_every: int = 10
    """A full base every this many steps; deltas in between."""
    retain: int = 5
    """Committed steps kept."""
    chunk_bytes: int = 4 * 1024 * 1024
    ram_bytes: int = 0
    """Budget for in-memory snapshots (bytes), 0 = no limit."""
    disk_quota_bytes: int = 0
    """Most bytes the local tier (snapshots and peers' shards) may hold, 0 = no limit."""


@dataclass(frozen=True)
class S3Config:
    endpoint: str = ""
    bucket: str = ""
    prefix: str = "stalwart"
    region: str = ""


@dataclass(frozen=True)
class TlsConfig:
    cert: str = ""
    key: str = ""
    ca: str = ""


@dataclass(frozen=True)
class DaemonConfig:
    """The validated configuration of one daemon."""

    node: str = field(default_factory=socket.gethostname)
    job_id: str = "default"
    listen: str = "127.0.0.1:7070"
    """HOST:PORT of the TCP endpoint for peers and operators (port 0 = any free port)."""
    unix_socket: str = "/var/lib/stalwart/daemon.sock"
    """Path of the Unix socket for the ranks of this node."""
    data_dir: str = "/var/lib/stalwart"
    metrics_port: int = 9400
    """Port of the Prometheus /metrics endpoint on the listen host, 0 = off."""
    log_format: str = ""
    """"json" or "text"; empty = JSON lines unless stderr is a terminal."""
    log_level: str = "INFO"
    peers: tuple[str, ...] = ()
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    """A rank silent for this long (seconds) is declared dead."""
    token: str = ""
    etcd: str = ""
    """HOST:PORT of an etcd server: the coordinator is elected there (a lease of
    `etcd_lease_s` seconds). Empty: the smallest live node name coordinates."""
    etcd_lease_s: int = 3
    labels: Labels = field(default_factory=Labels)
    erasure: ErasureConfig = field(default_factory=ErasureConfig)
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    s3: S3Config = field(default_factory=S3Config)
    tls: TlsConfig = field(default_factory=TlsConfig)

    @property
    def listen_host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")


SECTION_TYPES = {
    "labels": Labels, "erasure": ErasureConfig, "elastic": ElasticSettings,
    "snapshot": SnapshotConfig,
    "s3": S3Config, "tls": TlsConfig,
}


def _name(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _coerce(name: str, spec: Key, value: Any, source: str, text: bool) -> Any:
    """Turn a TOML value, or an env/flag string (`text`), into the key's type."""
    kind = spec.kind
    text = text and isinstance(value, str)
    try:
        if kind == "str" and isinstance(value, str):
            return value
        if kind == "int" and not isinstance(value, bool):
            if isinstance(value, int):
                return value
            if text:
                return int(value.replace("_", ""))
        if kind == "float" and not isinstance(value, bool):
            if isinstance(value, int | float):
                return float(value)
            if text:
                return float(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if text and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
        if kind == "list":
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return [v.strip() for v in value]
            if text:
                return [v.strip() for v in value.split(",") if v.strip()]
    except ValueError:
        pass
    wanted = {"str": "a string", "int": "an integer", "float": "a number",
              "list": "a list of strings", "bool": "true or false"}[kind]
    raise ConfigError(f"{name}: must be {wanted}, got {value!r} ({source})")


def _set(merged: dict[str, dict[str, Any]], section: str, key: str, value: Any,
         source: str, text: bool = True) -> None:
    keys = SCHEMA.get(section)
    if keys is None:
        raise ConfigError(
            f"{section}: unknown section ({source}); allowed sections: "
            + ", ".join(s for s in SCHEMA if s))
    spec = keys.get(key)
    if spec is None:
        raise ConfigError(
            f"{_name(section, key)}: unknown key ({source}); allowed here: " + ", ".join(keys))
    name = _name(section, key)
    value = _coerce(name, spec, value, source, text)
    problem = spec.check(value) if spec.check else None
    if problem:
        raise ConfigError(f"{name}: {problem}, got {value!r} ({source})")
    merged[section][key] = value


def read_file(path: Path) -> dict[str, Any]:
    """Parse a TOML file; syntax errors become one-line ConfigErrors."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def env_overrides(env: Mapping[str, str]) -> dict[str, str]:
    """Dotted keys from STALWART_KEY and STALWART_SECTION__KEY variables.

    Variables that name no configuration key are left alone: clients and tools
    share the STALWART_ prefix for their own settings.
    """
    found: dict[str, str] = {}
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        section, _, key = var[len(ENV_PREFIX):].lower().rpartition("__")
        if key in SCHEMA.get(section, {}):
            found[_name(section, key)] = value
    return found


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> DaemonConfig:
    """Build the configuration: file < environment < overrides (dotted keys, from flags).

    Raises ConfigError with a one-line message naming the first bad key.
    """
    merged: dict[str, dict[str, Any]] = {s: {} for s in SCHEMA}
    if path is not None:
        where = f"in {path}"
        for top, value in read_file(Path(path)).items():
            if isinstance(value, dict):
                for key, inner in value.items():
                    _set(merged, top, key, inner, where, text=False)
            elif top in SCHEMA and top:
                raise ConfigError(f"{top}: must be a table [{top}] ({where})")
            else:
                _set(merged, "", top, value, where, text=False)
    for dotted, value in env_overrides(os.environ if env is None else env).items():
        section, _, key = dotted.rpartition(".")
        var = ENV_PREFIX + (f"{section}__{key}" if section else key).upper()
        _set(merged, section, key, value, f"from ${var}")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.rpartition(".")
        _set(merged, section, key, value, f"from --{dotted.replace('_', '-').replace('.', '-')}")
    return _build(merged)


def _build(merged: dict[str, dict[str, Any]]) -> DaemonConfig:
    top = {k: merged[""].get(k, spec.default) for k, spec in SCHEMA[""].items()}
    if not top["node"]:
        top["node"] = socket.gethostname()
    if not top["unix_socket"]:
        top["unix_socket"] = str(Path(top["data_dir"]) / "daemon.sock")
        problem = _socket_path(top["unix_socket"])
        if problem:
            raise ConfigError(f"unix_socket: <data_dir>/daemon.sock {problem} (set unix_socket)")
    top["peers"] = tuple(top["peers"])
    if top["heartbeat_timeout_s"] <= top["heartbeat_interval_s"]:
        raise ConfigError(
            f"heartbeat_timeout_s: must be greater than heartbeat_interval_s "
            f"({top['heartbeat_interval_s']:g}), got {top['heartbeat_timeout_s']:g}")
    sections = {
        name: cls(**{k: merged[name].get(k, spec.default) for k, spec in SCHEMA[name].items()})
        for name, cls in SECTION_TYPES.items()
    }
    tls = sections["tls"]
    if bool(tls.cert) != bool(tls.key):
        raise ConfigError("tls.cert: tls.cert and tls.key must be given together")
    return DaemonConfig(**top, **sections)
