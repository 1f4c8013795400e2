"""Prompt lookup's index proposes what a scan of the whole sequence finds: the tokens after
the latest earlier occurrence of the longest suffix n-gram, or, where none occurred and the
last token replaced one of the previous proposal, the tokens after the replaced one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.infer.lookup import extend_lookup, init_lookup, propose_lookup


def scan(tokens: list[int], k: int, min_n: int, max_n: int, last=None) -> tuple[list[int], tuple]:
    """The definition, by brute force: (the proposal, what the next scan takes as `last`)."""
    L = len(tokens)
    start = None
    for n in range(min(max_n, L), min_n - 1, -1):
        suffix = tokens[L - n :]
        found = [s for s in range(L - 1, n - 1, -1) if tokens[s - n : s] == suffix]
        if found:  # latest first; s < L: a follower exists
            start = found[0]
            break
    if start is None and last is not None:
        at, source, proposed = last
        written = tokens[at:]
        n = len(written)
        same_before = written[:-1] == proposed[: n - 1]
        if 0 < n <= len(proposed) and same_before and written[-1] != proposed[n - 1]:
            start = source + n if source + n < at else None
    if start is None:
        return [], None
    seq = list(tokens)
    while len(seq) < start + k:
        seq.append(seq[len(seq) - (L - start)])  # the span repeats itself
    out = seq[start : start + k]
    return out, ((L, start, out) if out else None)


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
    expected, last = scan(tokens[:split], k, min_n, min_n + extra)
    assert propose_lookup(index, k) == expected
    index = extend_lookup(index, tokens[split:])  # growing it equals building it whole
    assert propose_lookup(index, k) == scan(tokens, k, min_n, min_n + extra, last)[0]


def test_copying_proposes_the_rest_of_the_span():
    text = [5, 6, 7, 8, 9, 10]
    index = init_lookup([1, *text, 2, 5, 6], 1, 3)
    assert propose_lookup(index, 3) == [7, 8, 9]
    assert propose_lookup(extend_lookup(index, [7]), 10) == [8, 9, 10, 2, 5, 6, 7, 8, 9, 10]


def test_a_token_that_replaced_a_proposed_one_proposes_what_follows_it():
    text = [5, 6, 7, 8, 9, 10]
    index = init_lookup([1, *text, 2, 5, 6], 2, 3)
    assert propose_lookup(index, 3) == [7, 8, 9]
    index = extend_lookup(index, [70])  # in place of 7: the copy goes on after it
    assert propose_lookup(index, 3) == [8, 9, 10]
    index = extend_lookup(index, [8, 90])  # one kept, then one replaced
    assert propose_lookup(index, 2) == [10, 2]
    assert propose_lookup(extend_lookup(index, [10, 2]), 2) == [5, 6]  # copying again
    index = init_lookup([1, *text, 2, 5, 6], 2, 3)
    propose_lookup(index, 3)
    assert propose_lookup(extend_lookup(index, [70, 8]), 3) == []  # not the proposal's start
    assert propose_lookup(init_lookup([1, *text, 2, 5, 70], 2, 3), 3) == []  # no proposal


@pytest.mark.parametrize("sizes", [(0, 2), (3, 2)])
def test_bad_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="min_n"):
        init_lookup([1, 2], *sizes)
