"""A capture's JSON record, encoded with what did not change since the last capture
taken from the last encoding. From step to step most of a record is the same objects
(a StateRegistry reuses the records of unchanged tensors); encoding all 26 KB of a small
model's record again cost the training thread 0.2 ms a step."""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii  # json.dumps's own, for one string
from typing import Any

__all__ = ["Frozen", "RecordEncoder"]


class Frozen(dict):  # type: ignore[type-arg]
    """A record nobody changes once it is built: its encoding may be kept by identity."""


class RecordEncoder:
    """`json.dumps(record, sort_keys=True)`, reusing the text of each `Frozen` part that
    the previous record also held."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[Frozen, str]] = {}
        self._now: dict[int, tuple[Frozen, str]] = {}

    def encode(self, record: dict[str, Any]) -> bytes:
        try:
            return self._text(record).encode()
        finally:  # what this record did not hold is forgotten
            self._last, self._now = self._now, {}

    def _text(self, value: Any) -> str:
        if type(value) is Frozen:
            kept = self._last.get(id(value))
            if kept is None or kept[0] is not value:
                kept = (value, json.dumps(value, sort_keys=True))
            self._now[id(value)] = kept
            return kept[1]
        if type(value) is dict and all(type(k) is str for k in value):
            return "{" + ", ".join(f"{encode_basestring_ascii(k)}: {self._text(value[k])}"
                                   for k in sorted(value)) + "}"
        return json.dumps(value, sort_keys=True)
