"""Float matrices kept [out, in] as torch holds them, multiplied by our C kernel
(astrai/kernels/float_gemv.c) at the few rows of a decode step and by torch at more (a prompt):
one copy of the weights serves both.

Whether it beats the other layouts on the running machine is measured at load
(astrai.infer.prepare), like every other layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from astrai.kernels import gemv
from astrai.model.layers import cast


@functools.cache
def kernel_rows(dtype: torch.dtype) -> int:
    """Rows up to which the kernel runs: it streams the weights once for any number of rows.
    In float32 it still matched oneDNN's packed layout at 16 rows on a 2-core Intel Xeon; in
    bfloat16 its dot products (AVX-512 BF16) are bound by arithmetic past 4 rows, where torch's
    products (oneDNN, on AMX there) were 2-3x faster at 16, unless the kernel has AMX itself
    (astrai/kernels/amx.c: level with oneDNN's packed layout at 16 rows). Longer inputs (prompt
    chunks), where arithmetic, not reading the weights, is the cost, go to torch's product on
    the same tensor."""
    if dtype == torch.bfloat16 and gemv.float_isa() < gemv.FLOAT_AMX:
        return 4
    return 16


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
