"""Tensor names of the Hugging Face families where their checkpoints differ from our params
(whose keys are Llama's): projections stored as one matrix (Phi-3's qkv_proj and gate_up_proj).
`params_from_hf` turns a family's tensors into params; `params_to_hf` turns them back, for
`save_pretrained` of an imported model."""

from __future__ import annotations

import torch

from astrai.config import ModelConfig
from astrai.model.layers import FUSED
from astrai.model.params import param_shapes

Tensors = dict[str, torch.Tensor]

# The projections a family's checkpoints hold fused (names of astrai.model.layers.FUSED).
FUSED_IN_FILES = {"phi3": ("qkv_proj", "gate_up_proj")}


def params_from_hf(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    """A family's checkpoint tensors -> params. Tensors that do not fit are left as they are,
    for check_params to name."""
    params = dict(tensors)
    shapes = param_shapes(cfg)
    for fused in FUSED_IN_FILES.get(cfg.family, ()):
        for key in [k for k in tensors if k.endswith(f".{fused}.weight")]:
            prefix = key.removesuffix(f".{fused}.weight")
            parts = [f"{prefix}.{part}.weight" for part in FUSED[fused]]
            widths = [shapes.get(part, (0,))[0] for part in parts]
            if sum(widths) == tensors[key].shape[0]:
                params |= dict(zip(parts, params.pop(key).split(widths), strict=True))
    return params


def params_to_hf(params: Tensors, cfg: ModelConfig) -> Tensors:
    """params -> the tensors of the family's checkpoints."""
    tensors = dict(params)
    for fused in FUSED_IN_FILES.get(cfg.family, ()):
        first = FUSED[fused][0]
        for key in [k for k in params if k.endswith(f".{first}.weight")]:
            prefix = key.removesuffix(f".{first}.weight")
            parts = [tensors.pop(f"{prefix}.{part}.weight") for part in FUSED[fused]]
            tensors[f"{prefix}.{fused}.weight"] = torch.cat(parts)
    return tensors
