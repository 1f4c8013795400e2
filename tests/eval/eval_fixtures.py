"""A tiny random model with its tokenizer, saved as a model folder, for the evaluation tests."""

from pathlib import Path

import pytest

import astrai
from astrai.tokenizer import Tokenizer

TEXTS = [
    "the cat sat on the mat",
    "twelve plus thirty is 42",
    "a longer line of text, with commas and digits 1234, to cross a window or two",
    "héllo wörld: non-ASCII bytes count as bytes",
]


def tiny_model(folder: Path, max_len: int = 64) -> Path:
    tok = Tokenizer.train(TEXTS * 8, vocab_size=300)
    cfg = astrai.ModelConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=max_len,
    )  # fmt: skip
    params = astrai.init_params(cfg, seed=0)
    astrai.save_pretrained(folder, params, cfg, tokenizer=tok)
    return folder


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def short_model_dir(tmp_path_factory) -> Path:
    """A context of 8 tokens: texts span several rolling windows."""
    return tiny_model(tmp_path_factory.mktemp("short"), max_len=8)
