"""Constrained decoding: a grammar that decides which tokens may come next.

A `Constraint` names a grammar (a JSON schema, any JSON object, a regex, a list of choices or a
Lark grammar). `start_constraint` compiles it for a tokenizer and returns the per-request
constraint state, a grammar matcher; each step `allowed_tokens` gives the rows' next-token masks
for `sample`, and `accept_token` advances a matcher by the token sampled:

    matcher = start_constraint(json_schema({"type": "object"}), tokenizer)
    token = sample(logits, generator, allowed=allowed_tokens([matcher], vocab_size))
    matcher = accept_token(matcher, int(token))

The grammar engine is llguidance (see docs/structured-outputs.md for why): it compiles lazily,
so a new schema costs about a millisecond, and it refuses the JSON Schema keywords it cannot
enforce rather than ignoring them. Compiled grammars are cached per (grammar, tokenizer); a
request gets a copy of the cached matcher.
"""

from __future__ import annotations

import functools
import json
import weakref

import llguidance
import msgspec
import torch

# Compact JSON as json.dumps writes it: with free whitespace a model that knows no JSON can
# write blanks forever.
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class ConstraintError(ValueError):
    """A grammar the engine cannot compile or does not support; the message says what."""


class Constraint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A grammar in llguidance's form (see the constructors below). Equal constraints share
    one compiled grammar per tokenizer."""

    grammar: str


def json_schema(schema: dict | bool) -> Constraint:
    """Output that is JSON valid against `schema` (unsupported keywords raise ConstraintError)."""
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"a JSON schema is an object or a boolean, not {schema!r}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=JSON_STYLE
        )
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"bad JSON schema: {exc}") from None
    return Constraint(grammar)


def json_object() -> Constraint:
    """Any JSON object."""
    return json_schema({"type": "object"})


def regex(pattern: str) -> Constraint:
    """Output matching the regular expression (Rust regex syntax, matched whole)."""
    return Constraint(llguidance.grammar_from("regex", pattern))


def choice(options: list[str]) -> Constraint:
    """Exactly one of the strings."""
    if not options or not all(isinstance(o, str) for o in options):
        raise ConstraintError("choice needs a non-empty list of strings")
    return Constraint(llguidance.grammar_from("choice", json.dumps(options)))


def lark(grammar: str) -> Constraint:
    """A Lark grammar in llguidance's dialect (GBNF is accepted too); `start` is the root."""
    return Constraint(llguidance.grammar_from("lark", grammar))


# ---------------------------------------------------------------- compiling, with caches

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance sees it (built once per tokenizer and vocabulary size): its
    vocabulary padded to the model's vocab_size (padding tokens are never allowed), and the
    tokenizer's stop ids as the tokens that end a finished grammar."""
    sizes = _TOKENIZERS.setdefault(tokenizer, {})
    if vocab_size not in sizes:
        stops = sorted(tokenizer.stop_ids)
        if not stops:
            raise ConstraintError("constrained decoding needs a tokenizer with a stop token")
        try:
            sizes[vocab_size] = llguidance.LLTokenizer(
                tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=stops
            )
        except ValueError as exc:  # e.g. a tokenizer that cannot tell the bytes of its tokens
            raise ConstraintError(f"the grammar engine cannot read this tokenizer: {exc}") from None
    return sizes[vocab_size]


@functools.lru_cache(maxsize=256)
def _compiled(grammar: str, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ConstraintError(error.strip())
    return llguidance.LLMatcher(tokenizer, grammar)


def start_constraint(
    constraint: Constraint, tokenizer, vocab_size: int | None = None
) -> llguidance.LLMatcher:
    """A fresh matcher for one request, at the start of the grammar, over a model with
    vocab_size tokens (default: the tokenizer's). Raises ConstraintError for a grammar that
    does not compile. Needs a tokenizer: the grammar is over text."""
    if tokenizer is None:
        raise ConstraintError("constrained decoding needs a tokenizer")
    vocab_size = vocab_size or tokenizer.vocab_size
    return _compiled(constraint.grammar, grammar_tokenizer(tokenizer, vocab_size)).deep_copy()


# ---------------------------------------------------------------- one step


def allowed_tokens(
    matchers: list[llguidance.LLMatcher | None], vocab_size: int, device=None
) -> torch.Tensor | None:
    """The next-token masks [B, vocab_size] (True = allowed) of a batch; rows without a
    matcher allow everything. None when no row is constrained. The matchers must have been
    started for this vocab_size."""
    rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    # imported here: llguidance.torch compiles a kernel at import, which loads torch._dynamo
    # and inductor (~2 s), a cost every program and rank would pay without a grammar
    import llguidance.torch

    bits = llguidance.torch.allocate_token_bitmask(len(matchers), vocab_size)
    bits.fill_(-1)  # every bit set: free rows allow every token
    for matcher, row in rows:  # a finished grammar allows only the stop tokens
        llguidance.torch.fill_next_token_bitmask(matcher, bits, row)
    shifts = torch.arange(32, dtype=torch.int32)
    mask = ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(matchers), -1)[:, :vocab_size]
    return mask.to(device) if device is not None else mask


def accept_token(matcher: llguidance.LLMatcher, token: int) -> llguidance.LLMatcher:
    """The matcher advanced by the token sampled (donated: go on with the one returned).
    Raises ConstraintError for a token the grammar does not allow."""
    if not matcher.consume_token(token):
        raise ConstraintError(f"token {token} breaks the grammar: {matcher.get_error()}")
    return matcher


def is_finished(matcher: llguidance.LLMatcher) -> bool:
    """Whether the grammar is complete and allows nothing more (not even more text)."""
    return matcher.is_stopped()
