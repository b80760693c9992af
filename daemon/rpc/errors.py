"""Typed domain errors to gRPC status codes: the one table every servicer uses."""

from __future__ import annotations

from typing import NoReturn

import grpc

from stalwart.core.generation import StaleGeneration
from stalwart.daemon import errors

CODES: dict[type[Exception], grpc.StatusCode] = {
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Refused: grpc.StatusCode.PERMISSION_DENIED,
    errors.Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Invalid: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotReady: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    # Retryable: the caller follows the new plan and carries on (ABORTED, not fatal).
    StaleGeneration: grpc.StatusCode.ABORTED,
}
TYPED = tuple(CODES)
RECOVERABLE_STEP_KEY = "stalwart-recoverable-step"


def code_of(exc: Exception) -> grpc.StatusCode:
    for kind in type(exc).__mro__:
        if kind in CODES:
            return CODES[kind]
    return grpc.StatusCode.INTERNAL


async def abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """End the call with the status of `exc`'s kind and its message. A step beyond
    tolerance names the newest recoverable one in the trailing metadata too."""
    if isinstance(exc, errors.NotRecoverable) and exc.recoverable_step is not None:
        context.set_trailing_metadata(((RECOVERABLE_STEP_KEY, str(exc.recoverable_step)),))
    await context.abort(code_of(exc), str(exc))
    raise AssertionError("unreachable: abort raises")
