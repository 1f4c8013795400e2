"""The hardware limit of batch-1 decoding: every weight is read once per token, so no decoder
can beat memory bandwidth / bytes of weights per token. Bandwidth is measured STREAM-style in
the same run, on the same device and threads."""

from __future__ import annotations

import math

import torch

from astrai.bench.timing import timed
from astrai.config import ModelConfig
from astrai.model import param_shapes


def stream_bandwidth(device: torch.device, n: int = 1 << 25, repeats: int = 5) -> dict[str, float]:
    """GB/s of copy (b = a), triad (a = b + 3c) and read (sum a) over float32 arrays of n
    elements (128 MiB each by default, far beyond any cache). Best of `repeats`, as STREAM."""
    a = torch.rand(n, device=device)
    b = torch.rand(n, device=device)
    c = torch.rand(n, device=device)
    size = a.element_size() * n
    kernels = {
        "copy": (lambda: b.copy_(a), 2 * size),
        "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3 * size),
        "read": (lambda: a.sum(), size),
    }
    return {name: _best_rate(fn, nbytes, device, repeats) for name, (fn, nbytes) in kernels.items()}


def _best_rate(fn, nbytes: int, device: torch.device, repeats: int) -> float:
    fn()  # first touch: page faults are not bandwidth
    best = min(timed(fn, device)[0] for _ in range(repeats))
    return nbytes / best / 1e9


def decode_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of weights one batch-1 decode step must read: every matrix and norm once, one row
    of the embedding, and the head (the embedding matrix itself when tied). The K/V cache read
    is left out: at these lengths it is under 1% of the weights. For MoE every expert is
    counted, which overstates the bytes of a sparse step."""
    shapes = param_shapes(cfg)
    vocab, hidden = shapes["model.embed_tokens.weight"]
    elements = sum(math.prod(s) for k, s in shapes.items() if k != "model.embed_tokens.weight")
    elements += hidden
    if "lm_head.weight" not in shapes:
        elements += vocab * hidden
    return elements * torch.empty((), dtype=dtype).element_size()


def roofline_tokens_per_s(bandwidth_gb_s: float, bytes_per_token: int) -> float:
    return bandwidth_gb_s * 1e9 / bytes_per_token
