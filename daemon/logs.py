"""Structured logs for the daemon: JSON lines for machines, plain text for people.

Fields passed as ``log.info("msg", extra={"rank_id": ...})`` become JSON keys
(or ``key=value`` pairs in text), so events can be filtered without regexes.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO

# Attributes every LogRecord has; anything else came in through `extra`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, msg, then fields."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, object] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """`HH:MM:SS level logger: msg key=value ...` for a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        extra = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        line = f"{ts} {record.levelname.lower():<7} {record.name}: {record.getMessage()}"
        if extra:
            line += f"  {extra}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(fmt: str = "", level: str = "INFO", stream: IO[str] | None = None) -> None:
    """Send all logs to `stream` (stderr) in `fmt` ("json", "text", or "" = by tty)."""
    stream = stream or sys.stderr
    if not fmt:
        fmt = "text" if stream.isatty() else "json"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # gRPC's own Python loggers are chatty at INFO about internals.
    logging.getLogger("grpc").setLevel(max(logging.WARNING, root.level))
