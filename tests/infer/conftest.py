"""A tiny tokenizer shared by the inference tests."""

from __future__ import annotations

import pytest
import torch

from astrai.infer import prepare, support
from astrai.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    texts = ["hello world, the quick brown fox jumps over the lazy dog. " * 4] * 8
    texts += ["STOP here, and then go on; the end is near: éàü 日本語 🙂"] * 8
    return Tokenizer.train(texts, vocab_size=300)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine the threads'
    hand-offs make every small op slow; restore the setting for tests elsewhere."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fresh_choices():
    """What runs here and which product is fastest, found again inside the test and forgotten
    after it: both are cached for the process, and the test changes what they read."""
    caches = [
        support._probe,
        prepare._layout_seconds,
        prepare._fastest_layout,
        prepare._int8_seconds,
        prepare._fastest_int4,
    ]
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()
