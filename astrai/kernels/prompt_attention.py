"""Attention of a prompt's rows under a mask (prompt_attention.c): each block of query rows
reads only the keys its mask rows allow, where torch's fused CPU kernel computes every score and
masks it afterwards, so a causal prompt costs half the products (the figures: the C file).
float32 or bfloat16 inputs (widened: the sums are float32) on a CPU with AVX-512;
astrai/model/masked_attention.py takes it where it measures faster than torch's paths."""

from __future__ import annotations

import functools

import torch

from astrai.kernels.build import kernel_library

ERRORS = {-1: "a shape it does not take", -2: "out of memory", -3: "no AVX-512 here"}
MAX_DIM = 256  # prompt_attention.c's largest head
DTYPES = (torch.float32, torch.bfloat16)  # bfloat16 widened: the kernel's sums are float32


@functools.cache
def runs_here() -> bool:
    """Whether the kernel built and this CPU (as torch's kernels are held) has AVX-512."""
    lib = kernel_library()
    return lib is not None and bool(lib.astrai_masked_attention_isa())


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether masked_attention takes these: float32 or bfloat16 on the CPU, where it runs;
    heads at most MAX_DIM wide, V's as wide as K's; a mask [B or 1, 1, T, S], bool or additive
    in the inputs' dtype."""
    B, T, D, S = q.shape[0], q.shape[2], q.shape[3], k.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype
        and q.dtype in DTYPES
        and D <= MAX_DIM
        and v.shape[-1] == D
        and mask.dtype in (torch.bool, q.dtype)
        and mask.dim() == 4
        and mask.shape[0] in (1, B)
        and mask.shape[1:] == (1, T, S)
        and runs_here()
    )


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v. q [B, H, T, D]; k, v [B, Hkv, S, D], the query heads
    h = g * (H / Hkv) + j sharing K/V head g; mask [B or 1, 1, T, S], bool (True = may attend)
    or additive (-inf: may not), at least one key a row; float32 or bfloat16 (see `takes`), the
    kernel's scores and sums float32. Returns [B, H, T, D] in q's dtype."""
    if not takes(q, k, v, mask):
        raise ValueError(
            f"the prompt attention kernel does not take q {tuple(q.shape)} {q.dtype}, "
            f"k/v {tuple(k.shape)}, mask {tuple(mask.shape)} {mask.dtype} here"
        )
    B, H, T, D = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    dtype = q.dtype
    q, k, v = (t.float().contiguous() for t in (q, k, v))
    additive = mask.dtype != torch.bool
    mask = mask.float().contiguous() if additive else mask.contiguous()
    out = torch.empty(B, H, T, D)
    code = kernel_library().astrai_masked_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), int(additive), mask.shape[0],
        out.data_ptr(), B, H, kv_heads, T, S, D, D**-0.5 if scale is None else scale,
        torch.get_num_threads(),
    )  # fmt: skip
    if code:
        raise RuntimeError(
            f"the prompt attention kernel refused the call: {ERRORS.get(code, code)}"
        )
    return out.to(dtype)
