"""Tolerances from the dtype and the computation, never from one machine's run.

Two correct float computations of the same value differ by rounding: each operation rounds by
at most machine epsilon (relative), and a sum of n terms computed in a different order (another
CPU's kernel, AVX2 vs AVX-512 vs AMX blocking, another thread count splitting the reduction)
may differ by up to about n * eps times the sum of the terms' magnitudes. So a tolerance is
`eps(dtype) * roundings`, where `roundings` is the computation's conditioning factor: how many
roundings can pile up in one result (reduction lengths, layers, optimizer steps). Each test
states its factor and why. A test whose two sides take the same kernel path with the same
inputs compares exactly (torch.equal) instead, and says so.
"""

from __future__ import annotations

import pytest
import torch

FLOAT32_EPS = torch.finfo(torch.float32).eps


def forward_roundings(cfg, seq_len: int) -> int:
    """A forward pass: every layer reduces over the hidden size (projections, norms), the
    intermediate size (the MLP's down projection) and the sequence (attention), and the lm_head
    over the hidden size once more. The worst case is one rounding per term of each."""
    per_layer = 2 * cfg.hidden_size + cfg.intermediate_size + seq_len
    return cfg.num_hidden_layers * per_layer + cfg.hidden_size


def gradient_roundings(cfg, seq_len: int, tokens: int) -> int:
    """One gradient: the backward pass mirrors the forward's reductions, and each weight's
    gradient sums over every token of the batch."""
    return 2 * forward_roundings(cfg, seq_len) + tokens


def tolerance(roundings: float, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> dict:
    """assert_close's keyword arguments: rtol = roundings * eps; atol the same relative to
    `scale`, the magnitude of the values compared (errors of a sum are relative to its terms,
    so a value near zero from large terms carries their absolute error)."""
    rel = roundings * torch.finfo(dtype).eps
    return {"rtol": rel, "atol": rel * scale}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, roundings: float) -> None:
    """assert_close with the tolerance of `roundings` roundings in expected's dtype, atol
    relative to the largest magnitude among the values (at least 1)."""
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual, expected, **tolerance(roundings, expected.dtype, scale), equal_nan=False
    )


def approx(expected: float, roundings: float, dtype: torch.dtype = torch.float32):
    """pytest.approx for a scalar computed in `dtype` with `roundings` roundings."""
    rel = roundings * torch.finfo(dtype).eps
    return pytest.approx(expected, rel=rel, abs=rel)


def int8_block_half_steps(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """How far activations quantized to int8 per block of `block` inputs (step: the block's
    largest magnitude / 127, rounded to nearest) may be from x: half the step, widened by the
    float32 rounding of the step itself (a division and a product: 4 eps is ample)."""
    width = x.shape[-1]
    padded = torch.nn.functional.pad(x.abs(), (0, -width % block))  # a last block part empty
    amax = padded.unflatten(-1, (-1, block)).amax(-1, keepdim=True)
    half = (amax / 254 * (1 + 4 * FLOAT32_EPS)).expand(*x.shape[:-1], -1, block).flatten(-2)
    return half[..., :width]
