"""Mutual TLS for the daemon's TCP endpoint and its outbound channels to peers.

Certificates and keys are read from files. The server re-reads them when one of
the files changes (checked at each new connection), so certificates can be
rotated without a restart; established connections keep their session.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
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
    check_pair(tls.cert, tls.key, "tls.key")


def check_pair(cert: str, key: str, what: str) -> None:
    """Raise TlsError when the private key in `key` is not the one of the certificate in
    `cert` (gRPC would only log a raw handshake error at every connection)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert, key, password=lambda: b"")  # never a TTY prompt
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e) or "key values mismatch" in str(e):
            raise TlsError(f"{what}: key does not match certificate: {key} is not the private "
                           f"key of {cert}; use the .key made with that .pem") from None
        raise TlsError(f"{what}: cannot load the pair {cert} / {key} ({e.reason or e}); "
                       "see docs/security.md") from None


REQUIRES_TLS = ("this daemon requires TLS: {address} accepts only mutual TLS; set "
                "STALWART_TLS_CERT, STALWART_TLS_KEY and STALWART_TLS_CA (docs/security.md)")
_ALERTS = ("alert", "certificate required", "handshake failure")  # a TLS peer answered


def diagnose(address: str, tls: TlsConfig | None, timeout_s: float = 3.0) -> str:
    """Why a gRPC call to `address` could not connect, when TLS is the cause: one line
    for an operator, or "" when TLS is not the problem (or the port does not answer).

    `tls` is what the caller dials with (None: plaintext). gRPC reports every TLS
    mismatch as UNAVAILABLE; a handshake tried directly tells them apart: a daemon that
    speaks only TLS, a daemon certificate the caller's CA did not sign, a caller
    certificate the daemon refuses, a daemon without TLS.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if tls is None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    else:
        try:
            check_pair(tls.cert, tls.key, "STALWART_TLS_KEY")
            context = ssl.create_default_context(cafile=tls.ca)
        except TlsError as e:
            return str(e)
        except (OSError, ssl.SSLError) as e:
            return f"STALWART_TLS_CA: cannot load {tls.ca} ({e}); point it at the cluster's ca.pem"
        context.check_hostname = False  # names are gRPC's to check; trust is the question
        context.load_cert_chain(tls.cert, tls.key)
    context.set_alpn_protocols(["h2"])  # what gRPC speaks; a server drops a caller without
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError):
        return ""
    try:
        with context.wrap_socket(raw, server_hostname=host) as conn:
            conn.settimeout(timeout_s)
            # TLS 1.3 settles the client certificate after the handshake: an accepted
            # caller gets the server's HTTP/2 settings, a refused one the end of the stream.
            accepted = conn.recv(1) != b""
    except ssl.SSLCertVerificationError:
        return (f"certificate not trusted: the daemon at {address} presents a certificate "
                f"that {tls.ca if tls else 'the CA'} did not sign; set STALWART_TLS_CA to the "
                "cluster's ca.pem")
    except ssl.SSLError as e:
        answered = any(w in str(e).lower() for w in _ALERTS)
        if tls is None:
            return REQUIRES_TLS.format(address=address) if answered else ""
        if answered:
            return (f"certificate not trusted: the daemon at {address} refuses the "
                    f"certificate {tls.cert}; it must be signed by the cluster's CA")
        return (f"the daemon at {address} does not speak TLS; unset STALWART_TLS_CERT, "
                "STALWART_TLS_KEY and STALWART_TLS_CA to reach it")
    except OSError:
        return ""
    finally:
        raw.close()
    if tls is None:
        return REQUIRES_TLS.format(address=address)
    return "" if accepted else (
        f"certificate not trusted: the daemon at {address} refuses the certificate "
        f"{tls.cert}; it must be signed by the cluster's CA")


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
        files = _Files(_read("tls.cert", self.tls.cert), _read("tls.key", self.tls.key),
                       _read("tls.ca", self.tls.ca))
        check_pair(self.tls.cert, self.tls.key, "tls.key")  # half-rotated: keep the old pair
        return files

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
