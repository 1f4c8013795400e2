"""Decode attention that reads K/V where they lie in the page pool (attention.c).

A decode step that gathers each sequence's pages into one contiguous K and V per layer for
torch's fused kernel copies every sequence's keys and values, each layer of each step. Reading
them in place made a decode step of a 0.5B-shaped model 1.03-1.10x faster on a 2-core AMD EPYC
(programs/benchmark/paged_attention.py: int8 weights at batch 16, context 160 or 600, and at
batch 1), bfloat16 at batch 1 level (0.98x): there the step's weights, streamed between the
layers, evict the keys from the caches whichever way they are read. `decode_attention` also
rotates and stores the new token's query and key in the same call: 1.03-1.10x more on a 2-core
Intel Xeon, the ~20 small torch ops a layer it replaces being most of what a step does besides
the products.
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
    `window` of them when window > 0 (sliding-window layers). slots (int64 [B]): where each
    row's new key and value go in the pool, for `decode_attention` to write them itself."""

    table: torch.Tensor
    keys: torch.Tensor
    window: int = 0
    slots: torch.Tensor | None = None


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


def decode_attention(
    qkv: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: PagedMask,
    heads: int,
    scale: float | None,
) -> torch.Tensor:
    """A decode step's attention in one call: each row's new query and key rotated by rope (cos,
    sin [B, 1, D] float32; None: no rotation), its key and value written to its slot of the
    pool (mask.slots), then paged_attention over its pages, the new key among them.

    qkv [B, 1, (heads + 2 Hkv) * D]: the fused projection, float32 or bfloat16 (the rotated
    values rounded to it, as torch's RoPE rounds them); k, v: one layer of the pool, [pages,
    page_size, Hkv, D], written in place. RoPE, where given, spans whole heads. Returns
    [B, 1, heads * D] in qkv's dtype."""
    B = qkv.shape[0]
    pages, page_size, kv_heads, D = k.shape
    if qkv.shape[1] != 1 or qkv.shape[-1] != (heads + 2 * kv_heads) * D:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} is not one token's {heads} + 2 x {kv_heads} heads"
        )
    if not (k.is_contiguous() and v.is_contiguous()) or k.dtype != v.dtype:
        raise ValueError("k and v must be the pool's own [pages, page_size, Hkv, D] buffers")
    rows = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    cos, sin = (None, None) if rope is None else (t.float().contiguous() for t in rope)
    table, keys = mask.table.contiguous(), mask.keys.contiguous()
    out = torch.empty(B, 1, heads * D)
    code = kernel_library().astrai_paged_decode(
        rows.data_ptr(), rows.stride(0), int(rows.dtype == torch.bfloat16),
        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
        mask.slots.data_ptr(), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16),
        pages, table.data_ptr(), table.shape[1], keys.data_ptr(), mask.window, B, heads,
        kv_heads, D, page_size, D**-0.5 if scale is None else scale, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"the paged attention kernel refused the call: {ERRORS.get(code, code)}")
    return out.to(qkv.dtype)
