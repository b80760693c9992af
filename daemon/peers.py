"""The daemon's view of its peers: who they are, and one cached gRPC channel per address.

Every outbound call to a peer daemon (plans, prepares, commits, shards, repaired
manifests) goes through `PeerChannels`, so a daemon holds one connection per peer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from stalwart.daemon.background import until
from stalwart.daemon.security.tls import TlsConfig, aio_channel

T = TypeVar("T")

UntilLost = Callable[[str], Awaitable[None]]
"""`until_lost(node)` returns once membership declares that peer lost (or, for
`until_silent`, suspect)."""


@dataclass(frozen=True)
class Peer:
    """A live daemon of the job (this one included): its node name, HOST:PORT, labels."""

    node: str
    address: str
    labels: dict[str, str]


class PeerLost(ConnectionError):
    """A call to a peer given up because membership declared the peer lost meanwhile."""


async def never_lost(node: str) -> None:
    """An `UntilLost` for callers without a membership (tools, tests): never returns."""
    await asyncio.Event().wait()


async def unless_lost(call: Awaitable[T], node: str, until_lost: UntilLost,
                      what: str = "was declared lost") -> T:
    """`call`'s result, or PeerLost as soon as `until_lost(node)` returns (the call is
    cancelled). A frozen peer (SIGSTOP, a hung host) keeps its socket open and answers
    nothing: a call to it would wait out its whole deadline, with the work behind it,
    though the peer is already known lost. `until_lost` may also be membership's
    `until_silent` (`what` then says so)."""
    done = await until(call, until_lost(node))
    if done.cancelled():
        raise PeerLost(f"daemon {node} {what} during the call")
    return done.result()


QUIET = "went quiet (a heartbeat overdue)"  # `what` for calls given up at a suspicion


class PeerChannels:
    """One lazily made channel per peer address, stamped with this daemon's identity."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        # Outbound interceptors that carry this daemon's token and node (auth.stamp),
        # set once the token is known; channels are made after that.
        self.interceptors: Sequence[grpc.aio.ClientInterceptor] = ()
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            # round_robin: a seed that is a DNS name for many daemons reaches each in turn.
            # Short reconnect backoff: a daemon that restarts at the same address (a host
            # that comes back) is reached within seconds, not after gRPC's default 120 s.
            channel = self._channels[address] = aio_channel(
                address, self.tls, options=[
                    ("grpc.lb_policy_name", "round_robin"),
                    ("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000)],
                interceptors=list(self.interceptors))
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
