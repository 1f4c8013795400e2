"""DeepSeek-style mixture of experts: routed experts chosen top-k per token, plus shared ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from astrai.config import ModelConfig
from astrai.model.layers import ACTIVATIONS, Params, gated_mlp


def route(router_logits: torch.Tensor, cfg: ModelConfig):
    """Top-k expert ids and weights per token, and the load-balancing auxiliary loss."""
    probs = router_logits.float().softmax(dim=-1)
    weights, experts = probs.topk(cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # Switch-style balance loss: fraction of assignments times mean router probability.
    E = cfg.n_routed_experts
    load = F.one_hot(experts, E).float().sum(dim=(0, 1)) / experts.numel()
    aux = E * (load * probs.mean(dim=0)).sum()
    return experts, weights, aux


def moe(params: Params, cfg: ModelConfig, prefix: str, x: torch.Tensor, lora=None):
    """x [B, T, hidden] -> (y, aux_loss). Tokens are sorted by expert and each expert runs once
    on its contiguous slice, so the work is a handful of matmuls, not a loop over tokens."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    experts, weights, aux = route(F.linear(x, params[f"{prefix}.gate.weight"]), cfg)
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    token_of = order // cfg.num_experts_per_tok
    counts = torch.bincount(flat, minlength=cfg.n_routed_experts).tolist()
    gate_w = params[f"{prefix}.experts.gate_proj"]
    up_w = params[f"{prefix}.experts.up_proj"]
    down_w = params[f"{prefix}.experts.down_proj"]
    act = ACTIVATIONS[cfg.hidden_act]
    outputs = []
    for e, chunk in enumerate(x[token_of].split(counts)):
        if counts[e]:
            h = act(chunk @ gate_w[e].T) * (chunk @ up_w[e].T)
            outputs.append(h @ down_w[e].T)
    routed = torch.cat(outputs) * weights.flatten()[order, None].to(x.dtype)
    y = torch.zeros_like(x).index_add(0, token_of, routed)
    if cfg.n_shared_experts:
        y = y + gated_mlp(params, f"{prefix}.shared_experts", x, lora, cfg.hidden_act)
    return y.view(shape), aux
