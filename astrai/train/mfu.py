"""Model flops utilisation: the model's training flops per second over the machine's peak
matrix-product rate for the dtype at the run's thread count: the best rate of square 1024 x
1024 products this machine has shown, kept between runs (astrai/train/matmul_peak.py says why
one measurement under load is not enough, and what an MFU over 100% means).

Training flops per token are the usual estimate (Kaplan et al. 2020, PaLM's appendix B):
6 per weight of every matrix the token passes through (forward 2, backward 4; the embedding
is a lookup, a tied head counts once as the head) plus 12 x layers x attention width x
sequence length for the attention products (scores and values, forward and backward, over the
whole sequence as in PaLM's count, though a causal kernel skips half). A mixture of experts
counts every expert, which overstates a sparse step.
"""

from __future__ import annotations

import math

import torch

from astrai.config import ModelConfig
from astrai.model import param_shapes
from astrai.train.matmul_peak import matmul_peak_gflops, refreshed_peak_gflops

__all__ = ["matmul_peak_gflops", "mfu", "run_mfu", "seq_len_of", "train_flops_per_token"]


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training flops of one token in a sequence of `seq_len` (module docstring)."""
    shapes = param_shapes(cfg)
    embedding = "model.embed_tokens.weight"
    matrices = sum(math.prod(s) for k, s in shapes.items() if k != embedding and len(s) >= 2)
    if "lm_head.weight" not in shapes:
        matrices += math.prod(shapes[embedding])  # the tied head multiplies by the embedding
    attention = cfg.num_hidden_layers * cfg.num_attention_heads * cfg.dim_per_head * seq_len
    return 6.0 * matrices + 12.0 * attention


def run_mfu(
    tokens_per_s: float, cfg: ModelConfig, batch: dict, precision: str, device
) -> float | None:
    """The MFU of a run training `cfg` on batches shaped like `batch` in `precision`; None for
    a batch without token ids (a custom source's), whose length it cannot know. Each call
    times one more product, so the peak rises to the quietest moment of the run."""
    seq_len = seq_len_of(batch)
    if seq_len is None:
        return None
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    flops = train_flops_per_token(cfg, seq_len)
    return mfu(tokens_per_s, flops, refreshed_peak_gflops(torch.device(device), dtype))


def mfu(tokens_per_s: float, flops_per_token: float, peak_gflops: float) -> float:
    """The share (0-1) of the peak that `tokens_per_s` tokens of `flops_per_token` use."""
    return tokens_per_s * flops_per_token / (peak_gflops * 1e9)


def seq_len_of(batch: dict) -> int | None:
    """The sequence length of a training batch (its token-id tensors' last dimension)."""
    for key, value in batch.items():
        if key.endswith("_ids") and isinstance(value, torch.Tensor) and value.dim() == 2:
            return value.shape[-1]
    return None
