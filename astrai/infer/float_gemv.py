"""Float matrices kept [out, in] as torch holds them, multiplied by our C kernel
(astrai/kernels/float_gemv.c) at the few rows of a decode step and by torch at more (a prompt):
one copy of the weights serves both.

Whether it beats the other layouts on the running machine is measured at load
(astrai.infer.prepare), like every other layout.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from astrai.kernels import gemv
from astrai.model.layers import cast

MOST_ROWS = 16  # a decode step's rows the kernel may take: past it a step is a prompt's
FEW_ROWS = 4  # where its bfloat16 dot products (AVX-512 BF16) still lead on any CPU measured
TIMED_BYTES = 64 << 20  # weights the timing streams: more than most caches, as a step reads them


@functools.cache
def kernel_rows(dtype: torch.dtype) -> int:
    """Rows up to which the kernel runs: it streams the weights once for any number of rows.
    Longer inputs (prompt chunks), where arithmetic, not reading the weights, is the cost, go to
    torch's product on the same tensor. In float32, and in bfloat16 where the kernel has AMX
    tiles (astrai/kernels/amx.c), it matched or beat torch's products at 16 rows on every CPU
    measured. Its bfloat16 dot products without AMX differ by CPU: bound by arithmetic past
    four rows on a 2-core Intel Xeon, where torch's products (oneDNN, on AMX) were 2-3x faster
    at 16, but 1.3-2.2x faster than torch's on a 2-core AMD Zen 4. So there they are timed
    against torch's product on the same weights at MOST_ROWS rows, once a process."""
    if dtype != torch.bfloat16 or gemv.float_isa() >= gemv.FLOAT_AMX:
        return MOST_ROWS
    return MOST_ROWS if _kernel_leads_at(MOST_ROWS, dtype) else FEW_ROWS


def _kernel_leads_at(rows: int, dtype: torch.dtype, shape=(4096, 1024)) -> bool:
    """Whether the kernel multiplies `rows` rows by matrices of `shape` faster than torch's
    F.linear on the same tensors, streamed from memory one after the other (best of three
    alternating rounds)."""
    copies = max(TIMED_BYTES // (shape[0] * shape[1] * dtype.itemsize), 1)
    weights = [torch.full(shape, 0.01, dtype=dtype) for _ in range(copies)]
    kernels = [gemv.float_product(w) for w in weights]
    x = torch.full((rows, shape[1]), 0.5, dtype=dtype)
    sides = {
        "kernel": lambda: [run(x) for run in kernels],
        "torch": lambda: [F.linear(x, w) for w in weights],
    }
    best = dict.fromkeys(sides, float("inf"))
    for side in (*sides, *sides, *sides, *sides):  # the first round warms up
        start = time.perf_counter()
        sides[side]()
        best[side] = min(best[side], time.perf_counter() - start)
    return best["kernel"] < best["torch"]


@dataclass(frozen=True, eq=False)
class GemvMatrix:
    """W [out, in]; `linear(x)` is x @ W.T in x's dtype."""

    weight: torch.Tensor
    run: Callable[[torch.Tensor], torch.Tensor]
    kernel: str = "gemv"

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > kernel_rows(self.weight.dtype) * x.shape[-1] or x.requires_grad:
            return F.linear(x, self.weight)
        return cast(self.run(x), x.dtype)


def gemv_matrix(w: torch.Tensor) -> GemvMatrix:
    """w [out, in] (float32 or bfloat16 on the CPU, in a multiple of 16) for our kernel."""
    w = w.contiguous()
    return GemvMatrix(w, gemv.float_product(w))
