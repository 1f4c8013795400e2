"""Checkpoints: config.json + model.safetensors, ours or a Hugging Face folder of one of the
families of docs/models.md. A model read from such a folder is written back in its family's
form, which transformers reads.

Only safetensors are read: pickled weights (pytorch_model.bin) can run code on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from astrai.config import ModelConfig, write_model_config
from astrai.files import write_atomically
from astrai.model.hf_config import config_to_hf, model_config_from_json
from astrai.model.hf_keys import params_from_hf, params_to_hf
from astrai.model.params import DTYPES, param_shapes


class CheckpointError(ValueError):
    """A checkpoint folder does not hold the tensors its config describes."""


def save_pretrained(
    path, params: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer=None
) -> None:
    """Write config.json and model.safetensors (and the tokenizer files when given): ours, or
    for a model read from a Hugging Face folder (cfg.family), that family's.

    Each file is written to a temporary name and renamed, so a crash leaves no torn file.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = None if cfg.family is None else config_to_hf(cfg)  # refused before anything is written
    tensors = params if hf is None else params_to_hf(params, cfg)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    write_atomically(
        path / "model.safetensors", lambda tmp: save_file(tensors, tmp, {"format": "pt"})
    )
    if hf is None:
        write_atomically(path / "config.json", lambda tmp: write_model_config(tmp, cfg))
    else:
        text = json.dumps(hf, indent=2) + "\n"
        write_atomically(path / "config.json", lambda tmp: Path(tmp).write_text(text))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors = {}
        for name in files:
            tensors |= load_file(path / name)
        return tensors
    single = path / "model.safetensors"
    if single.exists():
        return load_file(single)
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise CheckpointError(f"{path}: only safetensors are loaded (pickle files can run code)")
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def load_pretrained(
    path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Read a folder written by `save_pretrained` or by transformers -> (params, cfg)."""
    path = Path(path)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    cfg = model_config_from_json(path / "config.json")
    tensors = _read_tensors(path)
    if json.loads((path / "config.json").read_text()).get("model_type") == cfg.family:
        tensors = params_from_hf(tensors, cfg)  # a Hugging Face folder, not ours
    # Old transformers checkpoints carry RoPE tables; tied models may repeat the embedding.
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    check_params(tensors, cfg, str(path))
    return {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, cfg


def check_params(params: dict[str, torch.Tensor], cfg: ModelConfig, source: str = "params") -> None:
    """Raise CheckpointError listing missing, unexpected and wrongly shaped tensors."""
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    wrong = sorted(
        f"{k}: {tuple(params[k].shape)} != {expected[k]}"
        for k in set(expected) & set(params)
        if tuple(params[k].shape) != expected[k]
    )
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:20])}{' ...' if len(items) > 20 else ''}"
        for label, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("wrong shape", wrong),
        )
        if items
    ]
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
