"""A capture's JSON record encoder: the text is json.dumps's, whatever parts it reuses."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.client.record_json import Frozen, RecordEncoder

plain = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
values = st.recursive(plain, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=4), inner, max_size=3).map(lambda d: Frozen(d) if len(d) % 2 else d),
    max_leaves=12)
records = st.dictionaries(st.text(max_size=4), values, max_size=4)


@given(records, records, st.lists(st.booleans(), min_size=4, max_size=4))
@settings(max_examples=200, deadline=None)
def test_each_encoding_is_json_dumps_with_sorted_keys(first, second, carry):
    """`second` also holds some of `first`'s parts, the same objects (as a registry's
    unchanged tensors): the encoding of each record is still its own."""
    encoder = RecordEncoder()
    for key, keep in zip(sorted(first), carry, strict=False):
        if keep:
            second[key] = first[key]
    for record in (first, second, first):
        assert encoder.encode(record) == json.dumps(record, sort_keys=True).encode()


def test_a_part_held_again_is_not_encoded_again(monkeypatch):
    encoder = RecordEncoder()
    part = Frozen({"w": {"__stalwart_tensor__": "model/w"}})
    assert encoder.encode({"model": part, "step": 1}) == \
        b'{"model": {"w": {"__stalwart_tensor__": "model/w"}}, "step": 1}'
    encoded: list[object] = []
    real = json.dumps
    monkeypatch.setattr(json, "dumps", lambda v, **kw: encoded.append(v) or real(v, **kw))
    assert encoder.encode({"model": part, "step": 2}) == \
        b'{"model": {"w": {"__stalwart_tensor__": "model/w"}}, "step": 2}'
    assert encoded == [2]
    other = Frozen({"w": {"__stalwart_tensor__": "model/v"}})
    assert b'"model/v"' in encoder.encode({"model": other, "step": 3})


def test_keys_that_are_not_strings_are_left_to_json():
    record = {"objects": {1: "a", 2: Frozen({"b": 1})}}
    assert RecordEncoder().encode(record) == json.dumps(record, sort_keys=True).encode()
