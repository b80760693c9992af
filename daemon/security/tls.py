"""Mutual TLS for the daemon's TCP endpoint and its outbound channels to peers.

Certificates and keys are read from files. The server re-reads them when one of
the files changes (checked at each new connection), so certificates can be
rotated without a restart; established connections keep their session.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from stalwart.daemon.config import TlsConfig

log = logging.getLogger("stalwart.daemon.security.tls")


class TlsError(ValueError):
    """A certificate, key or CA file is missing or unreadable; the message names it."""


def enabled(tls: TlsConfig) -> bool:
    """True when the configuration asks for TLS (cert and key given)."""
    return bool(tls.cert and tls.key)


def check(tls: TlsConfig) -> None:
    """Raise TlsError unless every file needed for mutual TLS is readable."""
    if not enabled(tls):
        return
    if not tls.ca:
        raise TlsError("tls.ca: mutual TLS needs the cluster CA certificate to check peers; "
                       "set --tls-ca (see docs/security.md to make one)")
    for key, path in (("tls.cert", tls.cert), ("tls.key", tls.key), ("tls.ca", tls.ca)):
        _read(key, path)


def _read(key: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsError(f"{key}: cannot read {path} ({e.strerror}); check the path and "
                       "that the daemon's user may read it") from None
    if b"-----BEGIN" not in data:
        raise TlsError(f"{key}: {path} is not a PEM file; see docs/security.md")
    return data


@dataclass(frozen=True)
class _Files:
    cert: bytes
    key: bytes
    ca: bytes


class ReloadingServerCredentials:
    """Server credentials that require a client certificate signed by the CA, and pick up
    new files on the next connection after any of them changes."""

    def __init__(self, tls: TlsConfig) -> None:
        check(tls)
        self.tls = tls
        self._lock = threading.Lock()
        self._stamp = self._mtimes()
        self.reloads = 0
        initial = self._configuration(self._load())
        self.credentials = grpc.dynamic_ssl_server_credentials(
            initial, self._fetch, require_client_authentication=True)

    def _mtimes(self) -> tuple[int, ...]:
        out = []
        for path in (self.tls.cert, self.tls.key, self.tls.ca):
            try:
                out.append(os.stat(path).st_mtime_ns)
            except OSError:
                out.append(-1)
        return tuple(out)

    def _load(self) -> _Files:
        return _Files(_read("tls.cert", self.tls.cert), _read("tls.key", self.tls.key),
                      _read("tls.ca", self.tls.ca))

    @staticmethod
    def _configuration(files: _Files) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(files.key, files.cert)], root_certificates=files.ca)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: a new configuration, or None to keep it."""
        with self._lock:
            stamp = self._mtimes()
            if stamp == self._stamp:
                return None
            try:
                files = self._load()
            except TlsError as e:
                # Half-written during a rotation: keep serving the old pair, retry next time.
                log.warning("TLS files changed but cannot be loaded yet: %s", e)
                return None
            self._stamp = stamp
            self.reloads += 1
        log.info("TLS certificate reloaded", extra={"cert": self.tls.cert})
        return self._configuration(files)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Credentials for dialling a peer: trust only the cluster CA, present our certificate.

    Read at channel creation; channels made after a rotation use the new files.
    """
    check(tls)
    return grpc.ssl_channel_credentials(
        root_certificates=_read("tls.ca", tls.ca), private_key=_read("tls.key", tls.key),
        certificate_chain=_read("tls.cert", tls.cert))


def client_credentials(tls: TlsConfig) -> grpc.ChannelCredentials | None:
    """Channel credentials for peers when TLS is configured, else None (plaintext)."""
    return channel_credentials(tls) if enabled(tls) else None


def aio_channel(address: str, tls: TlsConfig,
                options: list[tuple[str, object]] | None = None,
                interceptors: list[grpc.aio.ClientInterceptor] | None = None
                ) -> grpc.aio.Channel:
    """A grpc.aio channel to a peer daemon: mutual TLS when configured, else plaintext;
    `interceptors` (auth.stamp) add the caller's token and node to every call."""
    creds = client_credentials(tls)
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options,
                                         interceptors=interceptors or None)
    return grpc.aio.secure_channel(address, creds, options=options,
                                   interceptors=interceptors or None)
