"""Chapter 04's Bloom filter in Redis: sizing, no false negatives, a false-positive rate near theory."""

from __future__ import annotations

import pytest

from course.bloom import BloomFilter, false_positive_rate, optimal_size


def test_one_percent_needs_about_9_6_bits_and_7_hashes_per_item():
    m, k = optimal_size(1000, 0.01)
    assert m == pytest.approx(9585, abs=2)
    assert k == 7


def test_the_theoretical_rate_at_capacity_is_the_requested_rate():
    m, k = optimal_size(10_000, 0.01)
    assert false_positive_rate(m, k, 10_000) == pytest.approx(0.01, rel=0.02)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        optimal_size(0, 0.01)
    with pytest.raises(ValueError):
        optimal_size(10, 1.5)


def test_the_k_positions_of_an_item_are_stable_and_in_range():
    bf = BloomFilter(None, "b", capacity=100, error_rate=0.01)
    first = bf.positions("user:42")
    assert first == bf.positions("user:42")
    assert len(first) == bf.k and all(0 <= p < bf.m for p in first)


async def test_an_added_item_is_always_found(ans):
    bf = BloomFilter(ans.redis(), "bloom:t", capacity=2000, error_rate=0.01)
    await bf.add("one")
    assert await bf.might_contain("one")
    await bf.add_many(range(2000), chunk=300)
    assert all(await bf.might_contain_many(list(range(2000))))


async def test_the_measured_false_positive_rate_is_near_the_theory(ans):
    bf = BloomFilter(ans.redis(), "bloom:fp", capacity=2000, error_rate=0.02)
    await bf.add_many(range(2000))
    hits = await bf.might_contain_many(list(range(10**6, 10**6 + 10_000)))
    measured = sum(hits) / len(hits)
    assert 0.01 < measured < 0.03  # theory 0.02; sampling spread is about 0.0014
    assert 0.4 < await bf.bits_set() / bf.m < 0.6  # a well-sized filter is about half full


async def test_an_empty_filter_says_no(ans):
    bf = BloomFilter(ans.redis(), "bloom:empty", capacity=100)
    assert not await bf.might_contain("anything")
