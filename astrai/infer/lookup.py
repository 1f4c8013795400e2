"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's last
n tokens, for the largest n in [min_n, max_n] that occurred before. No model is needed; when
the output copies from the prompt (a summary quoting its source, an edit of given code), the
copied span proposes itself.

The index maps each n-gram to the position right after its latest occurrence that has a
follower, so a proposal costs max_n dictionary lookups whatever the context length, and
each new token costs max_n insertions. It sees only the tokens it is given: with speculation
those are the accepted ones, so a rejection needs no rollback here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class LookupIndex:
    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    # follows[n - min_n][gram] = the index after gram's latest occurrence that has a follower
    follows: list[dict[tuple[int, ...], int]] = field(default_factory=list)


def init_lookup(tokens: list[int], min_n: int = 1, max_n: int = 3) -> LookupIndex:
    """An index over `tokens` (a request's prompt, or prompt and output so far)."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"lookup n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    index = LookupIndex(min_n, max_n, [], [{} for _ in range(min_n, max_n + 1)])
    return extend_lookup(index, tokens)


def extend_lookup(index: LookupIndex, new_tokens: list[int]) -> LookupIndex:
    """Append tokens to the indexed sequence. The index is donated (updated in place)."""
    tokens = index.tokens
    for token in new_tokens:
        end = len(tokens)  # the n-grams ending just before `token` now have a follower
        for n, table in enumerate(index.follows, start=index.min_n):
            if end >= n:
                table[tuple(tokens[end - n : end])] = end
        tokens.append(token)
    return index


def propose_lookup(index: LookupIndex, k: int) -> list[int]:
    """Up to k tokens that followed the longest suffix n-gram seen before (the latest
    occurrence); [] when no suffix of min_n tokens or more occurred before.

    A continuation that runs into the end of the sequence goes on with itself, so a repeating
    span proposes k tokens of its repetition rather than stopping at the sequence's end."""
    tokens, length = index.tokens, len(index.tokens)
    for n in range(min(index.max_n, length), index.min_n - 1, -1):
        start = index.follows[n - index.min_n].get(tuple(tokens[length - n :]))
        if start is not None:
            out: list[int] = []
            for i in range(k):
                j = start + i
                out.append(tokens[j] if j < length else out[j - length])
            return out
    return []
