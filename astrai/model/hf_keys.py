"""Tensor names of the Hugging Face families where their checkpoints differ from our params
(whose keys are Llama's): projections stored as one matrix (Phi-3's qkv_proj and gate_up_proj),
and routed experts stored one tensor per expert and matrix (Qwen3-MoE, Mixtral) where we stack
them. `params_from_hf` turns a family's tensors into params; `params_to_hf` turns them back, for
`save_pretrained` of an imported model."""

from __future__ import annotations

import torch

from astrai.config import ModelConfig
from astrai.model.layers import FUSED
from astrai.model.params import param_shapes

Tensors = dict[str, torch.Tensor]

# The projections a family's checkpoints hold fused (names of astrai.model.layers.FUSED).
FUSED_IN_FILES = {"phi3": ("qkv_proj", "gate_up_proj")}
# Where a family's checkpoints keep a layer's mixture of experts, and the name of each expert's
# matrices: (the block's name, {our stacked tensor: the expert's matrix}).
EXPERTS_IN_FILES = {
    "qwen3_moe": ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
}  # fmt: skip


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
    for ours, theirs in _expert_keys(cfg).items():
        if isinstance(theirs, str) and theirs in params:  # a router, renamed
            params[ours] = params.pop(theirs)
        elif isinstance(theirs, list) and all(k in params for k in theirs):
            params[ours] = torch.stack([params.pop(k) for k in theirs])
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
    for ours, theirs in _expert_keys(cfg).items():
        if isinstance(theirs, str):
            tensors[theirs] = tensors.pop(ours)
        else:
            tensors |= dict(zip(theirs, tensors.pop(ours).unbind(), strict=True))
    return tensors


def _expert_keys(cfg: ModelConfig) -> dict[str, str | list[str]]:
    """{our key: the checkpoint's key (a router), or the keys of each expert's matrix (a tensor
    of stacked experts)} over the mixture-of-experts layers of the family's checkpoints."""
    if cfg.family not in EXPERTS_IN_FILES:
        return {}
    block, matrices = EXPERTS_IN_FILES[cfg.family]
    keys: dict[str, str | list[str]] = {}
    for i in filter(cfg.is_moe_layer, range(cfg.num_hidden_layers)):
        ours, theirs = f"model.layers.{i}.mlp", f"model.layers.{i}.{block}"
        keys[f"{ours}.gate.weight"] = f"{theirs}.gate.weight"
        for name, in_file in matrices.items():
            each = [f"{theirs}.experts.{e}.{in_file}.weight" for e in range(cfg.n_routed_experts)]
            keys[f"{ours}.experts.{name}"] = each
    return keys
