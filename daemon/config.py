"""Daemon configuration: a TOML file, then STALWART_* environment variables, then flags.

Every key is declared once in `daemon/config_schema.py` (SCHEMA: type, default, check
and meaning); the dataclasses below take their defaults from there.
"""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.daemon.config_schema import (
    ENV_PREFIX,
    KIND_NAMES,
    RENAMED,
    SCHEMA,
    SOCKET_NAME,
    ConfigError,
    Key,
    check_socket_path,
    default,
    socket_in,
)

# The settings as the daemon reads them. Types live here, defaults and meanings in SCHEMA.


@dataclass(frozen=True)
class Labels:
    rack: str = default("labels.rack")
    zone: str = default("labels.zone")

    def as_dict(self) -> dict[str, str]:
        """The labels that are set, as peers and placement see them."""
        return {k: v for k, v in (("rack", self.rack), ("zone", self.zone)) if v}


@dataclass(frozen=True)
class ElasticSettings:
    shrink: bool = default("elastic.shrink")
    mem_cap_bytes: int = default("elastic.mem_cap_bytes")
    grow_threshold: float = default("elastic.grow_threshold")
    resume_settle_s: float = default("elastic.resume_settle_s")


@dataclass(frozen=True)
class ErasureConfig:
    k: int = default("erasure.k")
    m: int = default("erasure.m")
    parity_to: str = default("erasure.parity_to")
    encode_threads: int = default("erasure.encode_threads")


@dataclass(frozen=True)
class SnapshotConfig:
    base_every: int = default("snapshot.base_every")
    retain: int = default("snapshot.retain")
    chunk_bytes: int = default("snapshot.chunk_bytes")
    slot_bytes: int = default("snapshot.slot_bytes")
    ram_tier_bytes: int = default("snapshot.ram_tier_bytes")
    local_copy: bool = default("snapshot.local_copy")
    disk_quota_bytes: int = default("snapshot.disk_quota_bytes")
    disk_full_replan_s: float = default("snapshot.disk_full_replan_s")
    disk_sync: str = default("snapshot.disk_sync")
    disk_sync_every_s: float = default("snapshot.disk_sync_every_s")


@dataclass(frozen=True)
class S3Config:
    endpoint: str = default("s3.endpoint")
    bucket: str = default("s3.bucket")
    prefix: str = default("s3.prefix")
    region: str = default("s3.region")


@dataclass(frozen=True)
class TlsConfig:
    cert: str = default("tls.cert")
    key: str = default("tls.key")
    ca: str = default("tls.ca")


@dataclass(frozen=True)
class DaemonConfig:
    """The validated configuration of one daemon. An empty `node` becomes the hostname,
    an empty `unix_socket` <data_dir>/daemon.sock."""

    node: str = default("node")
    job_id: str = default("job_id")
    listen: str = default("listen")
    unix_socket: str = default("unix_socket")
    data_dir: str = default("data_dir")
    metrics_port: int = default("metrics_port")
    log_format: str = default("log_format")
    log_level: str = default("log_level")
    peers: tuple[str, ...] = tuple(default("peers"))
    heartbeat_interval_s: float = default("heartbeat_interval_s")
    heartbeat_timeout_s: float = default("heartbeat_timeout_s")
    token: str = default("token")
    etcd: str = default("etcd")
    etcd_lease_s: int = default("etcd_lease_s")
    commit_fanout: int = default("commit_fanout")
    gossip_fanout: int = default("gossip_fanout")
    labels: Labels = field(default_factory=Labels)
    erasure: ErasureConfig = field(default_factory=ErasureConfig)
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    s3: S3Config = field(default_factory=S3Config)
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        # Frozen: the two values filled in at start-up are set once, here.
        if not self.node:
            object.__setattr__(self, "node", socket.gethostname())
        if not self.unix_socket:
            object.__setattr__(self, "unix_socket", socket_in(self.data_dir))

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
    raise ConfigError(f"{name}: must be {KIND_NAMES[kind]}, got {value!r} ({source})")


def _set(merged: dict[str, dict[str, Any]], section: str, key: str, value: Any,
         source: str, text: bool = True) -> None:
    keys = SCHEMA.get(section)
    if keys is None:
        raise ConfigError(
            f"{section}: unknown section ({source}); allowed sections: "
            + ", ".join(s for s in SCHEMA if s))
    name = _name(section, key)
    if name in RENAMED:
        raise ConfigError(f"{name}: {RENAMED[name]} ({source})")
    spec = keys.get(key)
    if spec is None:
        raise ConfigError(f"{name}: unknown key ({source}); allowed here: " + ", ".join(keys))
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
        if key in SCHEMA.get(section, {}) or _name(section, key) in RENAMED:
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
    config = DaemonConfig(**top, **sections)
    problem = None if top["unix_socket"] else check_socket_path(config.unix_socket)
    if problem:
        raise ConfigError(f"unix_socket: <data_dir>/{SOCKET_NAME} {problem} (set unix_socket)")
    return config
