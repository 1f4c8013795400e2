"""Decode attention that reads K/V where they lie in the page pool (attention.c).

A decode step that gathers each sequence's pages into one contiguous K and V per layer for
torch's fused kernel copies every sequence's keys and values, each layer of each step. Reading
them in place made a decode step of a 0.5B-shaped model 1.03-1.10x faster on a 2-core AMD EPYC
(programs/benchmark/paged_attention.py: int8 weights at batch 16, context 160 or 600, and at
batch 1), bfloat16 at batch 1 level (0.98x): there the step's weights, streamed between the
layers, evict the keys from the caches whichever way they are read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from astrai.kernels.build import kernel_library, why_absent

ERRORS = {
    1: "a shape is out of range (the head size must be a multiple of 8)",
    2: "a row sees no key, or more than its pages hold",
    3: "out of memory",
    4: "the page table names a page the pool lacks",
}


class PagedMask(NamedTuple):
    """What each query row sees when the keys are a layer of the page pool: the first
    `keys[b]` positions of row b, through its pages `table[b]` (int64 [B, W]), only the last
    `window` of them when window > 0 (sliding-window layers)."""

    table: torch.Tensor
    keys: torch.Tensor
    window: int = 0


def runs_here(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether paged_attention takes a pool of this dtype and head size here: float32 or
    bfloat16 on a CPU where our C kernels built, heads a multiple of 8 wide."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and head_dim % 8 == 0
        and why_absent() is None
    )


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: PagedMask, scale: float | None
) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query row per sequence, over its pages.

    q [B, H, 1, D]; k, v: one layer of the pool as attention reads it, [pages, Hkv, page_size,
    D], a transposed view of the pool's [pages, page_size, Hkv, D] buffer (that layout is what
    the kernel reads). Returns [B, H, 1, D] in q's dtype."""
    B, H, T, D = q.shape
    pages, kv_heads, page_size, _ = k.shape
    if T != 1:
        raise ValueError(f"paged attention takes one query row per sequence, not {T}")
    if not (k.transpose(1, 2).is_contiguous() and v.transpose(1, 2).is_contiguous()):
        raise ValueError("k and v must be views of the pool's [pages, page_size, Hkv, D] buffers")
    if k.dtype != v.dtype or k.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the pool must be float32 or bfloat16, not {k.dtype} / {v.dtype}")
    if mask.table.shape[0] != B or mask.keys.shape != (B,):
        raise ValueError(f"the mask's table and keys must have {B} rows, one per query row")
    rows = q.float()
    if rows.stride(1) != D or rows.stride(3) != 1:
        rows = rows.contiguous()
    table = mask.table.to(torch.long).contiguous()
    keys = mask.keys.to(torch.long).contiguous()
    out = torch.empty(B, 1, H, D)
    scale = D**-0.5 if scale is None else scale
    lib = kernel_library()
    code = lib.astrai_paged_attention(
        rows.data_ptr(), rows.stride(0), k.data_ptr(), v.data_ptr(),
        int(k.dtype == torch.bfloat16), pages, table.data_ptr(), table.shape[1], keys.data_ptr(),
        mask.window, B, H, kv_heads, D, page_size, scale, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"the paged attention kernel refused the call: {ERRORS.get(code, code)}")
    return out.transpose(1, 2).to(q.dtype)
