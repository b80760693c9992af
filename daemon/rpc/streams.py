"""Server streams with an idle deadline: a reader that stops taking pieces is let go.

A gRPC write cannot be cancelled once started, so the handler waits for it at most
`idle_s` and then ends the call; the write's late outcome is consumed quietly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def send_within(context: grpc.aio.ServicerContext, message: Any, idle_s: float) -> bool:
    """Write `message`; False when the reader took nothing for `idle_s` seconds (the
    handler should then return, which ends the call)."""
    write = asyncio.ensure_future(context.write(message))
    write.add_done_callback(_consume)
    done, _ = await asyncio.wait({write}, timeout=idle_s)
    if not done:
        return False
    write.result()
    return True
