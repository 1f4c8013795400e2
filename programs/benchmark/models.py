"""What the benchmark runs on: model shapes, workloads, the shared weights folder, prompts and a
tokenizer whose vocabulary matches the model exactly."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

import astrai
from astrai.tokenizer import Tokenizer

# Shapes in Hugging Face config.json terms (Llama's unless model_type says otherwise, COMMON
# filling what a shape leaves out); every one ties its embeddings.
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
    # the shape of Qwen2.5-0.5B as a Llama (no q/k/v biases): what llama.cpp users run
    "q05": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ),
    # the shape of Llama-3.2-1B (its llama3 RoPE scaling left out: the same work per token)
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
    ),
    # Gemma-3-270M: sandwich norms, QK-norm, 512-token windows on five layers of every six
    "gemma3-270m": dict(
        model_type="gemma3_text",
        hidden_size=640,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        intermediate_size=2048,
        vocab_size=262144,
        sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
        query_pre_attn_scalar=256,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rms_norm_eps=1e-6,
    ),
    # Qwen3-0.6B: QK-norm, head_dim 128 wider than hidden / heads
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
}
COMMON = dict(
    model_type="llama",
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.02,
)
SHAPE_FILE = "bench-shape.json"  # the spec a cached folder was written from


def hf_config(size: str) -> dict:
    """The config.json fields of a size: its shape over COMMON."""
    return {**COMMON, **SIZES[size]}


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
    window: tuple[int, int] = (8192, 4096)  # tokens, window of the window-only model (Mistral's)


def workload_of(fields: dict) -> Workload:
    """The Workload whose fields a worker received as JSON (its tuples arrive as lists)."""
    return Workload(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


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
    window=(1024, 256),
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
    """A cached folder is reused only if it was written from this size's spec and, when
    transformers is here, by transformers (so both sides surely read one and the same file).
    The spec is kept beside the weights: config.json alone cannot say, as transformers 5 moves
    fields (rope_theta into rope_parameters) when it writes them."""
    try:
        written = json.loads((folder / SHAPE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not (folder / "model.safetensors").exists():
        return False
    if has_transformers() and not written.get("transformers"):
        return False
    return written.get("config") == hf_config(size)


def model_folder(root: Path, size: str, seed: int = 0) -> Path:
    """root/models/<size>: random weights in a Hugging Face folder, written once and reused.

    transformers' model class of the size's model_type writes it when transformers is
    installed; otherwise our own save_pretrained does (the same keys and config.json fields).
    """
    folder = root / "models" / size
    if _matches(folder, size):
        return folder
    tmp = folder.with_name(f".{size}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    spec = hf_config(size)
    if has_transformers():
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = {k: v for k, v in spec.items() if k != "model_type"}
        config = AutoConfig.for_model(
            spec["model_type"], **fields, bos_token_id=None, eos_token_id=None
        )
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
    else:
        from astrai.model import model_config_from_json

        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(spec))
        cfg = model_config_from_json(tmp / "config.json")
        astrai.save_pretrained(tmp, astrai.init_params(cfg, seed=seed), cfg)
    written = {"config": spec, "transformers": has_transformers()}
    (tmp / SHAPE_FILE).write_text(json.dumps(written, indent=1) + "\n")
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
