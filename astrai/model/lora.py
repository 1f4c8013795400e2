"""LoRA as a separate pytree: low-rank updates to chosen weights, applied inside `forward`."""

from __future__ import annotations

import math

import torch

from astrai.config import LORA_TARGETS, ModelConfig


def init_lora(
    params: dict[str, torch.Tensor],
    cfg: ModelConfig,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = LORA_TARGETS,
    seed: int = 0,
) -> dict:
    """{"scale": alpha / rank, "weights": {key: {"A": [r, in], "B": [out, r]}}}.

    A is Kaiming-uniform and B zero, so the model starts exactly as the base model.
    targets are module names matched against each 2-D weight key (e.g. "q_proj").
    """
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for key, w in params.items():
        if w.dim() != 2 or not key.endswith(".weight"):
            continue
        if key.rsplit(".", 2)[-2] not in targets:
            continue
        out_dim, in_dim = w.shape
        bound = 1.0 / math.sqrt(in_dim)
        a = (torch.rand(rank, in_dim, generator=generator) * 2 - 1) * bound
        weights[key] = {
            "A": a.to(device=w.device, dtype=w.dtype),
            "B": torch.zeros(out_dim, rank, device=w.device, dtype=w.dtype),
        }
    if not weights:
        raise ValueError(f"no weight matches the LoRA targets {targets}")
    return {"scale": torch.tensor(alpha / rank), "weights": weights}


def merge_lora(params: dict[str, torch.Tensor], lora: dict) -> dict[str, torch.Tensor]:
    """A new params dict with every LoRA update folded into its weight."""
    merged = dict(params)
    for key, pair in lora["weights"].items():
        delta = lora["scale"] * (pair["B"].float() @ pair["A"].float())
        merged[key] = (params[key].float() + delta).to(params[key].dtype)
    return merged
