"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's last
n tokens, for the largest n in [min_n, max_n] that occurred before. No model is needed; when
the output copies from the prompt (a summary quoting its source, an edit of given code), the
copied span proposes itself.

When no suffix occurred before because the last token replaced one the previous proposal
copied (the target rejected it and wrote its own), the copy is taken to go on after the
replaced token: an output that copies a text often replaces one token of it (a changed word,
a renamed identifier, a model that copies imperfectly) and goes on copying. Otherwise such a
substitution costs two plain decode steps before a suffix matches again. Measured on the
speculation section's smol copier (107M weights): a fifth of its copied tokens were
substitutions, a quarter of its time went to those steps, and taking them for substitutions
moved its speedup from 1.91x to 2.26-2.39x.

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
    # the last proposal: (the sequence's length then, where it was copied from, its tokens)
    last: tuple[int, int, list[int]] | None = None


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
    occurrence); when none did and the last token replaced a token of the previous proposal
    (all before it as proposed), the tokens after the replaced one; else []. The proposal is
    kept in the index (donated) for the next call.

    A continuation that runs into the end of the sequence goes on with itself, so a repeating
    span proposes k tokens of its repetition rather than stopping at the sequence's end."""
    tokens, length = index.tokens, len(index.tokens)
    start = _follower(index)
    if start is None:
        start = _after_substitution(index)
    out: list[int] = []
    for i in range(k if start is not None else 0):
        j = start + i
        out.append(tokens[j] if j < length else out[j - length])
    index.last = (length, start, out) if out else None
    return out


def _follower(index: LookupIndex) -> int | None:
    """Where the latest earlier occurrence of the longest suffix n-gram ends, or None."""
    tokens, length = index.tokens, len(index.tokens)
    for n in range(min(index.max_n, length), index.min_n - 1, -1):
        start = index.follows[n - index.min_n].get(tuple(tokens[length - n :]))
        if start is not None:
            return start
    return None


def _after_substitution(index: LookupIndex) -> int | None:
    """Where the last proposal's copy goes on when the tokens written since are its first
    ones but the last, which replaced the proposed one; None otherwise."""
    if index.last is None:
        return None
    at, start, proposed = index.last
    written = index.tokens[at:]
    n = len(written)
    if not 0 < n <= len(proposed) or written[-1] == proposed[n - 1]:
        return None
    if written[:-1] != proposed[: n - 1] or start + n >= at:  # a repetition's: no source
        return None
    return start + n
