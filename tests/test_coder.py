"""Specs for the Reed-Solomon coder: any k of k+m shards give back the chunk."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.daemon.snapshot.coder import ZfecCodec, default_km

CODES = [(1, 1), (2, 1), (3, 2), (4, 2), (8, 2), (8, 3)]


@settings(max_examples=60, deadline=None)
@given(km=st.sampled_from(CODES), data=st.binary(min_size=0, max_size=5000), seed=st.randoms())
def test_any_k_shards_decode_to_the_original(km, data, seed):
    k, m = km
    codec = ZfecCodec(k, m)
    shards = codec.encode(data)
    assert len(shards) == k + m
    assert all(len(s) == codec.shard_size(len(data)) for s in shards)
    keep = seed.sample(range(k + m), k)
    assert codec.decode({i: bytes(shards[i]) for i in keep}, len(data)) == data


def test_every_k_subset_decodes_for_4_of_6():
    codec = ZfecCodec(4, 2)
    data = bytes(range(256)) * 41 + b"tail"
    shards = [bytes(s) for s in codec.encode(data)]
    for keep in itertools.combinations(range(6), 4):
        assert codec.decode({i: shards[i] for i in keep}, len(data)) == data


def test_data_shards_are_the_chunk_and_padding_is_recorded():
    codec = ZfecCodec(4, 2)
    data = b"x" * 10
    shards = codec.encode(memoryview(data))
    assert codec.shard_size(10) == 3 and codec.padding(10) == 2
    assert b"".join(bytes(s) for s in shards[:4]) == data + b"\0\0"


def test_fewer_than_k_shards_is_a_clear_error():
    codec = ZfecCodec(2, 1)
    shards = codec.encode(b"abcdef")
    with pytest.raises(ValueError, match="need 2 of 3"):
        codec.decode({2: shards[2]}, 6)


def test_wrong_shard_size_is_refused():
    codec = ZfecCodec(2, 1)
    with pytest.raises(ValueError, match="expected 3"):
        codec.decode({0: b"abcd", 2: b"abcd"}, 6)


def test_caller_shards_are_not_reordered_by_decode():
    codec = ZfecCodec(3, 2)
    data = bytes(range(90))
    shards = {i: bytes(s) for i, s in enumerate(codec.encode(data)) if i in (4, 1, 3)}
    before = dict(shards)
    assert codec.decode(shards, len(data)) == data
    assert shards == before


@pytest.mark.parametrize("nodes", [2, 4, 8, 16])
def test_default_code_fits_the_cluster_with_a_spare(nodes):
    k, m = default_km(nodes)
    assert m >= 1 and k + m <= nodes
    if nodes >= 4:
        assert k + m <= nodes - 1
