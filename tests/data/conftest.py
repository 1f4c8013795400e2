"""A small tokenizer and JSONL writing shared by the data tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astrai.tokenizer import Tokenizer

CORPUS = [
    f"The quick brown fox {i} jumps over the lazy dog; what is {i} + {i * 3}? It is {i * 4}."
    for i in range(300)
]


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    Tokenizer.train(CORPUS, vocab_size=400).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tok_dir)


def _write_jsonl(path: Path, records: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _chat(i: int, turns: int = 1) -> dict:
    messages = [{"role": "system", "content": "Be brief."}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"What is {i} + {t}?"},
            {"role": "assistant", "content": f"It is {i + t}." + " Indeed." * (i % 5)},
        ]
    return {"messages": messages, "id": i}


@pytest.fixture
def write_jsonl():
    """write_jsonl(path, records): records as JSONL; a str is written as the line itself."""
    return _write_jsonl


@pytest.fixture
def chat():
    """chat(i, turns=1): a conversation record whose assistant turns vary in length with i."""
    return _chat
