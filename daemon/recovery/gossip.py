"""Gossip, the outbound half of membership: every heartbeat interval this daemon calls
Gossip on each peer it knows and learns, from the replies, who else is out there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from stalwart.daemon.recovery.membership import Membership
from stalwart.v1 import peer_pb2, peer_pb2_grpc

log = logging.getLogger("stalwart.daemon.recovery.gossip")


async def gossip_forever(membership: Membership, me: Callable[[], peer_pb2.PeerInfo],
                         channel: Callable[[str], grpc.aio.Channel], interval_s: float,
                         stopping: asyncio.Event) -> None:
    """Call Gossip on every known peer each interval (seconds) until `stopping` is set."""
    while not stopping.is_set():
        started = time.monotonic()
        addresses = membership.targets()
        await asyncio.gather(*(_gossip_once(a, membership, me, channel, interval_s)
                               for a in addresses))
        try:
            await asyncio.wait_for(stopping.wait(),
                                   max(0.0, interval_s - (time.monotonic() - started)))
        except TimeoutError:
            pass


async def _gossip_once(address: str, membership: Membership,
                       me: Callable[[], peer_pb2.PeerInfo],
                       channel: Callable[[str], grpc.aio.Channel], timeout_s: float) -> None:
    stub = peer_pb2_grpc.PeerServiceStub(channel(address))
    try:
        info = me()
        info.view = membership.view()
        reply = await stub.Gossip(info, timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        # Unreachable peers are expected while a cluster starts; loss is judged by age.
        # A refusal is not: the daemons of this job do not share a token or a CA.
        refused = e.code() in (grpc.StatusCode.UNAUTHENTICATED,
                               grpc.StatusCode.PERMISSION_DENIED)
        log.log(logging.WARNING if refused else logging.DEBUG, "gossip failed: %s",
                e.details() if refused else e.code().name, extra={"peer": address})
        return
    membership.learn(reply, contacted=address)
