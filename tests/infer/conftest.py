"""A tiny tokenizer shared by the inference tests."""

from __future__ import annotations

import pytest

from astrai.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    texts = ["hello world, the quick brown fox jumps over the lazy dog. " * 4] * 8
    texts += ["STOP here, and then go on; the end is near: éàü 日本語 🙂"] * 8
    return Tokenizer.train(texts, vocab_size=300)
