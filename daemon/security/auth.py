"""Who is calling: the job token, the calling daemon's node, and the job secret file.

Between daemons the caller is the node its mTLS certificate names when TLS is on,
else the node it names in `stalwart-node` metadata, vouched for by the job token.
Ranks and operators prove themselves with the token. With no token configured the
daemon makes a per-job secret in its data dir (mode 0600) instead of running open.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, NoReturn

import grpc

TOKEN_METADATA = "stalwart-token"  # gRPC metadata key that carries the job token
NODE_METADATA = "stalwart-node"    # the calling daemon's node (checked against TLS when on)
TOKEN_FILE = "job.token"           # in data_dir: the per-job secret when none is configured


class Forbidden(Exception):
    """An authenticated caller asked for something its role does not allow (the message
    says what and who may); servicers answer PERMISSION_DENIED."""


def job_token(configured: str, data_dir: Path) -> str:
    """The configured token, else the secret already in `data_dir/job.token`, else a new
    one. The token in use is kept in that file (mode 0600) so that ranks and tools of the
    daemon's user on this node find it (stalwart.client.job_token)."""
    path = Path(data_dir) / TOKEN_FILE
    token = configured
    if not token:
        try:
            token = path.read_text().strip()
        except FileNotFoundError:
            token = ""
    token = token or secrets.token_urlsafe(32)
    tmp = path.with_name(f".{TOKEN_FILE}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(token + "\n")
    os.replace(tmp, path)
    return token


def token_matches(given: str, expected: str) -> bool:
    """Constant-time comparison of job tokens (any characters)."""
    return secrets.compare_digest(given.encode(), expected.encode())


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str:
    for k, value in context.invocation_metadata() or ():
        if k == key:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return ""


def tls_name(context: grpc.aio.ServicerContext) -> str:
    """The common name of the caller's verified certificate, "" without TLS."""
    names = (context.auth_context() or {}).get("x509_common_name") or []
    return names[0].decode("utf-8", "replace") if names else ""


async def _deny(context: grpc.aio.ServicerContext, metrics: Any, reason: str,
                code: grpc.StatusCode, message: str) -> NoReturn:
    metrics.auth_refused.labels(reason).inc()
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")


class Authenticator:
    """Checks callers of one daemon: `token` for ranks and operators, `daemon` for peers."""

    def __init__(self, token: str, tls: bool, metrics: Any) -> None:
        self.token, self.tls, self.metrics = token, tls, metrics

    async def token_holder(self, context: grpc.aio.ServicerContext, given: str = "",
                           who: str = "") -> None:
        """Abort with UNAUTHENTICATED unless the call carries the job token (`given` in the
        message itself, else in metadata); `who` names the caller in the refusal."""
        given = given or metadata_value(context, TOKEN_METADATA)
        if not token_matches(given, self.token):
            sent = f"{who} sent " if who else ""
            await _deny(context, self.metrics, "token", grpc.StatusCode.UNAUTHENTICATED,
                        f"{sent}{'a wrong' if given else 'no'} job token; ranks and tools "
                        "must run "
                        "with STALWART_TOKEN set to the daemon's token (or read "
                        f"<data_dir>/{TOKEN_FILE} on the daemon's node)")

    async def daemon(self, context: grpc.aio.ServicerContext) -> str:
        """The calling daemon's node name, or abort: a peer call from the ranks' socket, or
        without the node's certificate (TLS) or the job token (no TLS), is refused."""
        if (context.peer() or "").startswith("unix:"):
            await _deny(context, self.metrics, "listener", grpc.StatusCode.PERMISSION_DENIED,
                        "the ranks' Unix socket serves rank calls only; daemons call each "
                        "other on the TCP port")
        claimed = metadata_value(context, NODE_METADATA)
        if self.tls:
            name = tls_name(context)
            if not name:
                await _deny(context, self.metrics, "tls", grpc.StatusCode.UNAUTHENTICATED,
                            "peer calls need a node certificate of the cluster CA")
            if claimed and claimed != name:
                await _deny(context, self.metrics, "identity", grpc.StatusCode.PERMISSION_DENIED,
                            f"certificate names node {name!r} but the call claims {claimed!r}; "
                            "a daemon's certificate must carry its node name as common name")
            return name
        await self.token_holder(context)
        if not claimed:
            await _deny(context, self.metrics, "identity", grpc.StatusCode.UNAUTHENTICATED,
                        f"peer calls must name the calling node in {NODE_METADATA!r} metadata")
        return claimed


def _with_metadata(details: Any, extra: tuple[tuple[str, str], ...]) -> Any:
    metadata = list(details.metadata or ())
    have = {k for k, _ in metadata}
    metadata += [(k, v) for k, v in extra if k not in have]
    return details._replace(metadata=metadata)


class _Stamp:
    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self.pairs = pairs


class _StampUnaryUnary(_Stamp, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_metadata(details, self.pairs), request)


class _StampUnaryStream(_Stamp, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_metadata(details, self.pairs), request)


class _StampStreamUnary(_Stamp, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self.pairs), request_iterator)


class _StampStreamStream(_Stamp, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self.pairs), request_iterator)


def stamp(token: str, node: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a daemon's outbound channels: every call carries its token and node
    (the channel API takes one interceptor per call shape)."""
    pairs = ((TOKEN_METADATA, token), (NODE_METADATA, node))
    return [cls(pairs) for cls in (_StampUnaryUnary, _StampUnaryStream, _StampStreamUnary,
                                   _StampStreamStream)]
