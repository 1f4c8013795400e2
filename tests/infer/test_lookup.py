"""Prompt lookup's index proposes what a scan of the whole sequence finds: the tokens after
the latest earlier occurrence of the longest suffix n-gram."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.infer.lookup import extend_lookup, init_lookup, propose_lookup


def scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, by brute force."""
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        suffix = tokens[L - n :]
        for start in range(L - 1, n - 1, -1):  # latest first; start < L: a follower exists
            if tokens[start - n : start] == suffix:
                seq = list(tokens)
                while len(seq) < start + k:
                    seq.append(seq[len(seq) - (L - start)])  # the span repeats itself
                return seq[start : start + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=40),
    split=st.integers(0, 40),
    k=st.integers(0, 6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_index_proposes_what_a_scan_finds(tokens, split, k, min_n, extra):
    index = init_lookup(tokens[:split], min_n, min_n + extra)
    assert propose_lookup(index, k) == scan(tokens[:split], k, min_n, min_n + extra)
    index = extend_lookup(index, tokens[split:])  # growing it equals building it whole
    assert propose_lookup(index, k) == scan(tokens, k, min_n, min_n + extra)


def test_copying_proposes_the_rest_of_the_span():
    text = [5, 6, 7, 8, 9, 10]
    index = init_lookup([1, *text, 2, 5, 6], 1, 3)
    assert propose_lookup(index, 3) == [7, 8, 9]
    assert propose_lookup(extend_lookup(index, [7]), 10) == [8, 9, 10, 2, 5, 6, 7, 8, 9, 10]


@pytest.mark.parametrize("sizes", [(0, 2), (3, 2)])
def test_bad_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="min_n"):
        init_lookup([1, 2], *sizes)
