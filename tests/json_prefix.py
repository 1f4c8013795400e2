"""Whether a text is JSON valid against a schema, or the start of such JSON: what a constrained
output cut short by max_tokens must be.

The grammar is compiled here by llguidance directly, in its default (whitespace-flexible) JSON
style, over a tokenizer whose tokens are single bytes: the check shares neither the engine's
compiled grammar nor the model's tokenizer, so it reads the text the user got, byte by byte.
"""

from __future__ import annotations

import functools
import json

import jsonschema
import llguidance
import tokenizers
from tokenizers import decoders, models, pre_tokenizers


@functools.cache
def _bytes() -> tuple[tokenizers.Tokenizer, llguidance.LLTokenizer]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return backend, llguidance.LLTokenizer(backend.to_str(), eos_token=len(alphabet))


def read(text: str, schema: dict | bool) -> llguidance.LLMatcher:
    """A matcher of `schema`'s JSON that has read `text`, byte by byte (is_error() when the
    text left the grammar)."""
    backend, tokenizer = _bytes()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    matcher.consume_tokens(backend.encode(text).ids)
    return matcher


def assert_json_prefix(text: str, schema: dict | bool) -> None:
    """`text` can be continued into JSON valid against `schema` (it may already be whole)."""
    matcher = read(text, schema)
    assert not matcher.is_error(), f"{text!r} leaves the grammar of {schema}: {matcher.get_error()}"


def assert_follows_schema(text: str, schema: dict | bool, finish_reason: str) -> None:
    """A constrained output: JSON valid against `schema` when it ended by itself ("stop"), the
    start of such JSON when max_tokens cut it ("length")."""
    assert finish_reason in ("stop", "length"), finish_reason
    if finish_reason == "stop":
        jsonschema.validate(json.loads(text), schema)
    assert_json_prefix(text, schema)
