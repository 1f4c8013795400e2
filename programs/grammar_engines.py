"""Compare the grammar engines for constrained decoding on our tokenizers: compile time per
schema, time per next-token mask, and what each does with JSON Schema keywords.

    pip install xgrammar          # not a dependency of AstrAI; llguidance is
    python programs/grammar_engines.py [--vocab-size 8000]

The figures in docs/structured-outputs.md come from this program.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llguidance
import llguidance.torch
import torch
import xgrammar

from astrai.tokenizer import Tokenizer

TIMED = {
    "object, bounded integer, string array": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age"],
    },
    "enum, nested object": {
        "type": "object",
        "properties": {
            "kind": {"enum": ["a", "b", "c"]},
            "inner": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
        },
        "required": ["kind", "inner"],
    },
    "pattern, minLength/maxLength": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]+$"},
            "s": {"type": "string", "minLength": 2, "maxLength": 5},
        },
        "required": ["code", "s"],
    },
    "anyOf": {
        "anyOf": [
            {"type": "integer"},
            {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"]},
        ]
    },
    "recursive $ref / $defs": {
        "$defs": {
            "p": {
                "type": "object",
                "properties": {
                    "n": {"type": "string"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/p"}},
                },
                "required": ["n"],
            }
        },
        "$ref": "#/$defs/p",
    },
    "format date-time": {
        "type": "object",
        "properties": {"t": {"type": "string", "format": "date-time"}},
        "required": ["t"],
    },
    "exclusiveMinimum on numbers": {"type": "number", "exclusiveMinimum": 0.5, "maximum": 3.25},
}

# (keyword, schema, an output that violates it)
VIOLATIONS = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, "4"),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{3}$"}, '"abcd"'),
    ("minLength", {"type": "string", "minLength": 3}, '"a"'),
    ("maximum", {"type": "integer", "maximum": 10}, "11"),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1.5}, "1.5"),
    ("minItems", {"type": "array", "minItems": 2}, "[1]"),
    (
        "required",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        "{}",
    ),
    (
        "additionalProperties",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        '{"b":1}',
    ),
    ("minProperties", {"type": "object", "minProperties": 1}, "{}"),
    ("format email", {"type": "string", "format": "email"}, '"nope"'),
    (
        "if/then",
        {
            "type": "object",
            "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
            "then": {"required": ["b"]},
        },
        '{"a":1}',
    ),
    ("not", {"not": {"type": "string"}}, '"x"'),
]


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    return (
        ((bits[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().reshape(-1)[:vocab]
    )


def walk(fill, advance, done, vocab: int, steps: int = 200) -> tuple[float, float]:
    """A random walk through allowed tokens -> (median, worst) seconds per mask."""
    g, times = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        if done():
            break
        start = time.perf_counter()
        bits = fill()
        times.append(time.perf_counter() - start)
        allowed = unpack(bits, vocab).nonzero()[:, 0]
        if not len(allowed) or not advance(
            int(allowed[torch.randint(len(allowed), (1,), generator=g)])
        ):
            break
    return statistics.median(times), max(times)


class Llg:
    name = "llguidance"

    def __init__(self, tok: Tokenizer):
        self.tok = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=sorted(tok.stop_ids))
        self.vocab = tok.vocab_size

    def matcher(self, schema: dict):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error.strip().splitlines()[0])
        return llguidance.LLMatcher(self.tok, grammar)

    def time_masks(self, m):
        bits = llguidance.torch.allocate_token_bitmask(1, self.vocab)

        def fill():
            llguidance.torch.fill_next_token_bitmask(m, bits, 0)
            return bits

        return walk(fill, m.consume_token, m.is_stopped, self.vocab)

    def accepts(self, m, ids: list[int]) -> bool:
        return m.consume_tokens(ids) and m.is_accepting()


class Xgr:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer):
        vocab = tok.backend.get_vocab(with_added_tokens=True)
        encoded = [""] * tok.vocab_size
        for text, i in vocab.items():
            encoded[i] = text
        info = xgrammar.TokenizerInfo(
            encoded,
            vocab_type=xgrammar.VocabType.BYTE_LEVEL,
            vocab_size=tok.vocab_size,
            stop_token_ids=sorted(tok.stop_ids),
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab, self.eos = tok.vocab_size, tok.eos_id

    def matcher(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
        return xgrammar.GrammarMatcher(compiled)

    def time_masks(self, m):
        bits = xgrammar.allocate_token_bitmask(1, self.vocab)

        def fill():
            m.fill_next_token_bitmask(bits, 0)
            return bits

        return walk(fill, m.accept_token, m.is_terminated, self.vocab)

    def accepts(self, m, ids: list[int]) -> bool:
        return all(m.accept_token(i) for i in ids) and (
            m.is_terminated() or m.accept_token(self.eos)
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab-size", type=int, default=8000)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    text = "\n".join(
        p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    )
    tok = Tokenizer.train([text], vocab_size=args.vocab_size)
    engines = [Llg(tok), Xgr(tok)]
    print(f"tokenizer: byte-level BPE, {tok.vocab_size} tokens\n")
    print(
        "| schema | "
        + " | ".join(f"{e.name} compile | {e.name} mask, median (worst)" for e in engines)
        + " |"
    )
    for name, schema in TIMED.items():
        cells = []
        for engine in engines:
            start = time.perf_counter()
            m = engine.matcher(schema)
            compile_ms = (time.perf_counter() - start) * 1e3
            median, worst = engine.time_masks(m)
            cells.append(f"{compile_ms:.1f} ms | {median * 1e6:.0f} µs ({worst * 1e3:.1f} ms)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n| keyword | " + " | ".join(e.name for e in engines) + " |")
    for keyword, schema, bad in VIOLATIONS:
        cells = []
        for engine in engines:
            try:
                m = engine.matcher(schema)
            except Exception as exc:  # the engine refuses the schema
                cells.append(f"refuses the schema: {str(exc)[:70]}")
                continue
            cells.append(
                "ACCEPTS the violation" if engine.accepts(m, tok.encode(bad)) else "enforced"
            )
        print(f"| {keyword} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
