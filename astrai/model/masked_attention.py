"""Attention with an explicit mask (cached and paged inference, packed documents) and square
causal attention: torch's fused kernels, two batched matrix products and a softmax, or (in
inference) our C kernel, whichever measures faster here.

torch's fused CPU attention kernel (the flash kernel SDPA takes on a CPU) computed a bf16 paged
prefill of 4 x 512 tokens of the small benchmark model at ~150 GFLOP/s on AMD Zen 4: 14-16 ms
a layer, 43% of the prefill, mask or is_causal alike. The same attention as products ran the
two products at ~900 GFLOP/s (oneDNN's bf16 kernels): 7.9 against 16.6 ms, and 2-2.5x faster
from 256 to 4,096 query rows over 256 to 2,048 keys. In float32 the fused kernel was as fast
or up to 2.3x faster. Training shows the same: forward and backward of the demo's packed
attention (32 x 128 tokens, 4 heads sharing 2 K/V heads of 32) took 18-20 ms in bf16 through
the fused kernel and 7-10 ms as products on AMD Zen 5, 11 against 11-17 ms in float32; the
benchmark's small model without a mask (8 x 256 tokens, 8 heads sharing 2 of 64) 40 ms through
the fused causal kernel and 19 ms as products in bf16, 41 against 48 ms in float32.
Inference measures which wins on the running machine, once per dtype and head shape
(`products_win`), and, where the CPU has AVX-512, whether our own prompt kernel beats both
(`kernel_wins`; astrai/kernels/prompt_attention.c: it reads only the keys each block of query
rows may see, 2.7x torch's fused kernel on a 4 x 512 causal prompt of the 0.5B shape on AMD
Zen 5, float32). Training takes the products exactly where it runs in bf16 that the CPU
multiplies natively: a rule rather than a timing, so that a resumed run takes the path the
first one took and resumes bit-exactly. One query row (a decode step) keeps the fused kernel:
products measured faster in isolation at 64 rows and no faster in a decode step (a paged
decode step on a CPU skips this module: astrai/kernels/paged_attention.py).

The products hold the scores in the inputs' dtype, as Hugging Face's eager attention holds
them; the softmax accumulates in float32 either way. For the backward pass they keep the
probabilities (B x heads x T x S, at most MAX_SCORES), where the fused kernel keeps one
number per query row.
"""

from __future__ import annotations

import functools
import logging
import math
import time

import torch
import torch.nn.functional as F

from astrai.hardware import native_bf16
from astrai.kernels import prompt_attention
from astrai.kernels.prompt_attention import masked_attention as prompt_kernel

log = logging.getLogger("astrai.infer")

MAX_SCORES = 1 << 25  # scores held at once (64 MiB in bf16); more go to the fused kernel


def causal_mask(queries: int, keys: int, device=None) -> torch.Tensor:
    """bool [queries, keys], True = may attend: the queries are the last `queries` of the
    `keys` positions, each seeing itself and every key before it."""
    ones = torch.ones(queries, keys, dtype=torch.bool, device=device)
    return ones.tril(keys - queries)


def attend_by_products(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v. q [B, H, T, D]; k [B, Hkv, S, D]; v [B, Hkv, S, Dv];
    mask bool [B, 1, T, S], True = may attend, at least one key per query (or the same as an
    additive mask of 0 and -inf in q's dtype). The query heads that share a K/V head are
    multiplied as one matrix, so K and V are read once. softcap: the scores s become
    softcap * tanh(s / softcap) before the mask (Gemma 2)."""
    B, H, T, D = q.shape
    heads, S = k.shape[1], k.shape[2]
    groups = H // heads
    scale = D**-0.5 if scale is None else scale
    rows = (q * scale).reshape(B, heads, groups * T, D)
    scores = torch.matmul(rows, k.transpose(-1, -2))
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        mask = torch.zeros((), dtype=scores.dtype, device=q.device).masked_fill(~mask, -math.inf)
    scores.view(B, heads, groups, T, S).add_(mask[:, :, None])
    return torch.matmul(scores.softmax(-1), v).view(B, H, T, -1)


def attend_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """The same through torch's fused kernel. The query heads that share a K/V head become
    extra query rows, so stored K/V are read once per K/V head instead of being copied for
    every query head (the copy dominated batched decoding)."""
    B, H, T, D = q.shape
    groups = H // k.shape[1]
    rows = q.reshape(B, k.shape[1], groups * T, D)
    rows_mask = mask if T == 1 or groups == 1 else mask.repeat(1, 1, groups, 1)
    o = F.scaled_dot_product_attention(rows, k, v, attn_mask=rows_mask, scale=scale)
    return o.view(B, H, T, -1)


def attend_fused_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Square causal attention (T == S, no mask) through torch's fused causal kernel, which
    skips the blocks above the diagonal; K/V are repeated for every query head that shares
    them, since the kernel's causal path wants as many K/V heads as query heads."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def attend_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v by the faster path here (module docstring): our prompt
    kernel for inference's prompt chunks where it wins (`_kernel_pays`), the products
    for prompt chunks and training sequences where they pay (`_products_pay`), the fused kernel
    otherwise."""
    if _kernel_pays(q, k, v, mask):
        return prompt_kernel(q, k, v, mask, scale)
    if _products_pay(q, k):
        return attend_by_products(q, k, v, mask, scale)
    return attend_fused(q, k, v, mask, scale)


def attend_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Square causal attention without a mask (training, a whole prompt without a cache): our
    prompt kernel over a causal mask in inference where it wins (`_kernel_pays`), the products
    over one in training where they pay (`_products_pay`), the fused causal kernel otherwise."""
    # without gradients, our prompt kernel where it wins, else torch's causal kernel (not the
    # products: inference's timing is of chunks after cached keys)
    if not torch.is_grad_enabled() and q.shape[2] == k.shape[2] > 1:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)[None, None]
        if _kernel_pays(q, k, v, mask):
            return prompt_kernel(q, k, v, mask, scale)
    if torch.is_grad_enabled() and _products_pay(q, k):
        mask = causal_mask(q.shape[2], k.shape[2], q.device)[None, None]
        return attend_by_products(q, k, v, mask, scale)
    return attend_fused_causal(q, k, v, scale)


def _kernel_pays(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether our prompt kernel is the path: inference (no gradient: the kernel has none),
    more than one query row, inputs it takes (float32 or bfloat16 on a CPU with AVX-512), and
    measured faster than torch's path here for this dtype and head shape (`kernel_wins`)."""
    if torch.is_grad_enabled() or q.shape[2] == 1 or not prompt_attention.takes(q, k, v, mask):
        return False
    return kernel_wins(q.dtype, k.shape[1], q.shape[1] // k.shape[1], q.shape[3])


def _products_pay(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether attend_by_products is the path for these queries and keys: more than one query
    row, scores that fit MAX_SCORES, and then in training bf16 that the CPU multiplies natively
    (module docstring), in inference products measured faster for this head shape."""
    B, H, T, D = q.shape
    if T == 1 or B * H * T * k.shape[2] > MAX_SCORES:
        return False
    if torch.is_grad_enabled():
        return q.dtype == torch.bfloat16 and _native_bf16(q.device.type)
    return products_win(q.dtype, q.device.type, k.shape[1], H // k.shape[1], D)


@torch.compiler.assume_constant_result
def _native_bf16(device_type: str) -> bool:
    """native_bf16 on a CPU (a GPU keeps its fused kernels), asked by compiled training steps
    as they are traced: a constant of the graph (dynamo would otherwise trace the reading of
    /proc/cpuinfo)."""
    return device_type == "cpu" and native_bf16(device_type)


def _best_of_three(fn, *args, give_up: float = float("inf")) -> float:
    """fn's best time of three runs after a warm-up; only the warm-up's when it took longer
    than give_up seconds (bf16 products where torch emulates bf16, on an AVX2 CPU: 100 ms
    against the fused kernel's 4)."""
    start = time.perf_counter()
    fn(*args)
    if (best := time.perf_counter() - start) > give_up:
        return best
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


CHUNK = (256, 1024)  # the prompt chunk the paths are timed at: 256 tokens after 768 cached


def _race(first, second, dtype: torch.dtype, heads: int, groups: int, head_dim: int) -> tuple:
    """(first's, second's) best time on a random CHUNK-sized prompt chunk (K/V heads `heads`,
    `groups` query heads each), logged; second gives up past four times first's."""
    T, S = CHUNK
    g = torch.Generator().manual_seed(0)  # the global generator's stream stays the caller's
    q = torch.randn(1, heads * groups, T, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(1, heads, S, head_dim, generator=g).to(dtype) for _ in range(2))
    chunk = (q, k, v, causal_mask(T, S)[None, None], None)
    a = _best_of_three(first, *chunk)
    b = _best_of_three(second, *chunk, give_up=4 * a)
    log.info(
        "%s attention, %d-token chunk over %d keys (%d x %d heads of %d): %s %.2f ms, %s %.2f ms",
        str(dtype).removeprefix("torch."), T, S, heads, groups, head_dim, second.__name__,
        b * 1e3, first.__name__, a * 1e3,
    )  # fmt: skip
    return a, b


@functools.cache
def kernel_wins(dtype: torch.dtype, heads: int, groups: int, head_dim: int) -> bool:
    """Whether our prompt kernel beats the faster of torch's fused kernel and the products
    here for `dtype` inputs, at products_win's chunk (256 tokens after 768 cached), timed once
    per process and logged."""
    products = products_win(dtype, "cpu", heads, groups, head_dim)
    torchs = attend_by_products if products else attend_fused
    theirs, ours = _race(torchs, prompt_kernel, dtype, heads, groups, head_dim)
    return ours < theirs


@functools.cache
def products_win(
    dtype: torch.dtype, device_type: str, heads: int, groups: int, head_dim: int
) -> bool:
    """Whether attend_by_products beats the fused kernel here by more than 10%, for a chunk of
    256 tokens after 768 cached ones (K/V heads `heads`, `groups` query heads each), timed once
    per process and logged. The margin is there because the fused kernel holds no scores: as
    chunks grow the products fall behind it where they were level (float32 here: 0.94x at this
    size, 0.43x at 512 tokens after 1,536). Off the CPU the fused kernels are kept."""
    if device_type != "cpu":
        return False
    fused, products = _race(attend_fused, attend_by_products, dtype, heads, groups, head_dim)
    return products < 0.9 * fused
