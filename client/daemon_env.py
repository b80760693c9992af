"""What a training process knows of its daemon and its place before it connects: the
daemon's gRPC target and TLS credentials from the environment, and the torchrun
environment (`RankEnv`), and where its capture threads run (STALWART_CAPTURE_CPUS)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from stalwart.daemon.config_schema import daemon_socket


class DaemonUnavailable(RuntimeError):
    """The local daemon could not be reached or refused the call; the message says why."""

    @property
    def code(self) -> grpc.StatusCode | None:
        """The gRPC status of the call (None when no call was made)."""
        return getattr(self.__cause__, "code", lambda: None)()


def default_target(env: Mapping[str, str] | None = None) -> str:
    """gRPC target of the local daemon: $STALWART_ADDRESS (HOST:PORT), else its Unix socket
    as the daemon's own defaults place it (stalwart.daemon.config.daemon_socket)."""
    env = os.environ if env is None else env
    if env.get("STALWART_ADDRESS"):
        return env["STALWART_ADDRESS"]
    return f"unix:{daemon_socket(env)}"


def tls_credentials(env: Mapping[str, str] | None = None) -> grpc.ChannelCredentials | None:
    """Mutual-TLS credentials for a daemon's TCP port from $STALWART_TLS_CERT, _KEY and _CA
    (PEM files, as made by scripts/make-certs.sh), or None when they are unset."""
    env = os.environ if env is None else env
    names = ("STALWART_TLS_CERT", "STALWART_TLS_KEY", "STALWART_TLS_CA")
    if not any(env.get(n) for n in names):
        return None
    missing = [n for n in names if not env.get(n)]
    if missing:
        raise DaemonUnavailable(f"TLS needs all of {', '.join(names)}; {', '.join(missing)} "
                                "not set")
    files = []
    for name in names:
        try:
            with open(env[name], "rb") as f:
                files.append(f.read())
        except OSError as e:
            raise DaemonUnavailable(f"${name}: cannot read {env[name]} ({e.strerror})") from None
    from stalwart.daemon.security.tls import TlsError, check_pair

    try:  # before gRPC sees them: it would only log a raw error at every connection
        check_pair(env["STALWART_TLS_CERT"], env["STALWART_TLS_KEY"], "STALWART_TLS_KEY")
    except TlsError as e:
        raise DaemonUnavailable(str(e)) from None
    cert, key, ca = files
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


@dataclass(frozen=True)
class RankEnv:
    """The torchrun-compatible environment of this process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = ""
    master_port: int = 0

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> RankEnv:
        """Read RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (a single process
        when they are unset, as torch.distributed assumes)."""
        env = os.environ if env is None else env

        def number(name: str, default: int) -> int:
            raw = env.get(name, "")
            try:
                return int(raw) if raw else default
            except ValueError:
                raise ValueError(f"${name} must be an integer, got {raw!r}") from None

        return cls(number("RANK", 0), number("WORLD_SIZE", 1), number("LOCAL_RANK", 0),
                   env.get("MASTER_ADDR", ""), number("MASTER_PORT", 0))


CPUS_ENV = "STALWART_CAPTURE_CPUS"


def parse_cpus(text: str, what: str = CPUS_ENV) -> frozenset[int] | None:
    """CPU numbers from a list like "3", "2,3" or "8-11,14" (None for ""); a ValueError
    names `what` and what is wrong (a CPU this machine does not have included)."""
    text = text.strip()
    if not text:
        return None
    have = os.cpu_count() or 1
    cpus: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or \
                int(high or low) < int(low):
            raise ValueError(f"{what}={text!r}: give CPU numbers like 3, 2,3 or 8-11")
        cpus.update(range(int(low), int(high or low) + 1))
    if max(cpus) >= have:
        raise ValueError(f"{what}={text!r}: this machine has CPUs 0-{have - 1}")
    return frozenset(cpus)


def capture_cpus() -> frozenset[int] | None:
    """The CPUs STALWART_CAPTURE_CPUS gives the capture threads (None: where the rank is)."""
    return parse_cpus(os.environ.get(CPUS_ENV, ""))
