"""What the benchmark runs on: model shapes, workloads, the shared weights folder, prompts and a
tokenizer whose vocabulary matches the model exactly."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

import astrai
from astrai.config import ModelConfig
from astrai.tokenizer import Tokenizer

# Shapes in Hugging Face Llama config.json terms; every one ties its embeddings.
SIZES: dict[str, dict] = {
    # for smoke runs and tests: seconds, not minutes
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        vocab_size=4096,
    ),
    "small": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1408,
        vocab_size=32000,
    ),
    # the shape of SmolLM-135M
    "smol": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
    ),
}
COMMON = dict(
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.02,
)


@dataclass(frozen=True)
class Workload:
    """How much work each section does."""

    prompt_len: int = 32
    new_tokens: int = 128
    concurrency: tuple[int, ...] = (16, 64)
    prefill: tuple[int, int] = (4, 512)  # batch, tokens
    train: tuple[int, int] = (8, 256)  # batch, tokens
    train_steps: int = 2  # optimizer steps per measured round
    clients: int = 16  # concurrent streaming clients against the server
    rounds: int = 3  # measured rounds per side, interleaved
    compile_train: bool = True


FULL = Workload()
QUICK = Workload(
    new_tokens=32,
    concurrency=(4, 16),
    prefill=(2, 128),
    train=(4, 64),
    train_steps=1,
    clients=8,
    rounds=2,
    compile_train=False,  # compiling takes minutes; a smoke run must not
)


def has_transformers() -> bool:
    """Whether the reference can run; also quiets its logging and progress bars."""
    try:
        import transformers
    except ImportError:
        return False
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return True


def _matches(folder: Path, size: str) -> bool:
    """A cached folder is reused only if it has this shape and, when transformers is here,
    was written by transformers (so both sides surely read one and the same file)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not (folder / "model.safetensors").exists():
        return False
    if has_transformers() and "architectures" not in config:
        return False
    return all(config.get(k) == v for k, v in {**SIZES[size], **COMMON}.items())


def model_folder(root: Path, size: str, seed: int = 0) -> Path:
    """root/models/<size>: random weights in a Hugging Face folder, written once and reused.

    transformers' LlamaForCausalLM.save_pretrained writes it when transformers is installed;
    otherwise our own save_pretrained does (the same keys and config.json fields).
    """
    folder = root / "models" / size
    if _matches(folder, size):
        return folder
    tmp = folder.with_name(f".{size}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    if has_transformers():
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**SIZES[size], **COMMON, bos_token_id=None, eos_token_id=None)
        LlamaForCausalLM(config).save_pretrained(tmp)
    else:
        cfg = ModelConfig(**SIZES[size], **COMMON)
        astrai.save_pretrained(tmp, astrai.init_params(cfg, seed=seed), cfg)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # a folder appears whole or not at all
    return folder


def bench_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer with exactly `vocab_size` tokens ("t0" ... ) and no special
    tokens: nothing can end a generation early, and every id decodes to text."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend)


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """n distinct prompts of random token ids (distinct, so no prefix cache can help)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=generator).tolist()
