"""Float matrices kept [out, in] as torch holds them, multiplied by our C kernel
(astrai/kernels/float_gemv.c) at the few rows of a decode step and by torch's or oneDNN's
product at more (a prompt): one copy of the weights serves both.

Whether it beats the other layouts on the running machine is measured at load
(astrai.infer.prepare), like every other layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from astrai.infer.ahead import one_row_ahead
from astrai.kernels import gemv
from astrai.model.layers import cast
from astrai.model.products import mkldnn_linear
from astrai.timing import best_of_rounds, pass_seconds

SURE_ROWS = 16  # rows the kernel led or matched torch's products at on every CPU measured
FEW_ROWS = 4  # the same for its bfloat16 dot products (AVX-512 BF16, no AMX)
TIMED_ROWS = (16, 32, 64)  # more rows a decode step may have (requests); a prompt's are more
TIMED_BYTES = 64 << 20  # weights the timing streams: more than most caches, as a step reads them
PROMPT_ROWS = 512  # a prompt chunk's rows (the Engine's prefill_chunk): prompt_product's timing


@functools.cache
def kernel_rows(dtype: torch.dtype) -> int:
    """Rows up to which the kernel runs: it streams the weights once for any number of rows.
    Longer inputs (prompt chunks), where arithmetic, not reading the weights, is the cost, go to
    the prompt's product on the same tensor (prompt_product). How far the kernel leads differs
    by CPU, so past what held everywhere it is timed against that product on the same weights
    at each of TIMED_ROWS, once a process. In float32, and in bfloat16 where the kernel has AMX
    tiles (astrai/kernels/amx.c), it matched or beat torch's products at 16 rows on every CPU
    measured; at 64 rows, in float32, it led torch's unpacked product 1.1-2x on a 2-core AMD
    Zen 4 (where torch's float32 product is MKL's), and on a 2-core AMD Zen 5 it led oneDNN's
    on the same tensor at 32 (the 0.5B shape's matrices: 274-309 against 246-273 GFLOP/s) but
    trailed it at 64 (236-312 against 312-345). Its bfloat16 dot products without AMX are
    bound by arithmetic past four rows on a 2-core Intel Xeon, where torch's products (oneDNN,
    on AMX) were 2-3x faster at 16, but led torch's 1.3-2.2x on the AMD Zen 4."""
    rows = sure_rows(dtype)
    for more in (n for n in TIMED_ROWS if n > rows):
        if not _kernel_leads_at(more, dtype):
            break
        rows = more
    return rows


def sure_rows(dtype: torch.dtype) -> int:
    """Rows up to which the kernel matched or beat torch's products on every CPU measured,
    untimed: SURE_ROWS, or FEW_ROWS for bfloat16 dot products without AMX (kernel_rows)."""
    amx = gemv.float_isa() >= gemv.FLOAT_AMX
    return SURE_ROWS if dtype != torch.bfloat16 or amx else FEW_ROWS


def _seconds(products: dict, rows: int, dtype: torch.dtype, copies: int, shape=(4096, 1024)):
    """{name: best seconds} of each product of `products` ({name: weight -> run(x)}) over
    `copies` matrices of `shape`, streamed one after the other at `rows` rows (best_of_rounds)."""
    weights = [torch.full(shape, 0.01, dtype=dtype) for _ in range(copies)]
    x = torch.full((rows, shape[1]), 0.5, dtype=dtype)
    sides = {name: [build(w) for w in weights] for name, build in products.items()}
    return best_of_rounds(sides, functools.partial(pass_seconds, x=x))


def _kernel_leads_at(rows: int, dtype: torch.dtype, shape=(4096, 1024)) -> bool:
    """Whether the kernel multiplies `rows` rows by matrices of `shape` faster than the
    prompt's product (prompt_product) on the same tensors, streamed from memory one after the
    other."""
    copies = max(TIMED_BYTES // (shape[0] * shape[1] * dtype.itemsize), 1)
    products = {"kernel": gemv.float_product, "torch": _bound(prompt_product(dtype))}
    best = _seconds(products, rows, dtype, copies, shape)
    return best["kernel"] < best["torch"]


def _bound(product: Callable) -> Callable:
    """weight -> run(x): product(x, weight) with the weight fixed."""
    return lambda w: functools.partial(product, weight=w)


@functools.cache
def prompt_product(dtype: torch.dtype) -> Callable:
    """The product for inputs of more rows than kernel_rows (a prompt), on the kernel's plain
    tensor: torch's F.linear, or oneDNN's linear where it multiplies PROMPT_ROWS rows faster
    here, timed once a process. torch's float32 F.linear on the CPU is MKL's, which on a 2-core
    AMD Zen 4 ran 5-40% behind oneDNN's on the same tensor (the 0.5B shape's matrices at 64 to
    2,048 rows; 56 against 95 GFLOP/s for the 9728 x 896 gate-up at 64)."""
    if not torch.backends.mkldnn.is_available():
        return F.linear
    products = {product: _bound(product) for product in (F.linear, mkldnn_linear)}
    best = _seconds(products, PROMPT_ROWS, dtype, copies=2)
    return min(best, key=best.get)


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
        if x.requires_grad:
            return F.linear(x, self.weight)
        if x.numel() > kernel_rows(self.weight.dtype) * x.shape[-1]:
            return prompt_product(self.weight.dtype)(x, self.weight)
        return cast(self.run(x), x.dtype)


def gemv_matrix(w: torch.Tensor) -> GemvMatrix:
    """w [out, in] (float32 or bfloat16 on the CPU, in a multiple of 16) for our kernel."""
    # all timed now, as weights are prepared, not in a request's first step
    one_row_ahead(gemv.BFLOAT16 if w.dtype == torch.bfloat16 else gemv.FLOAT32)
    kernel_rows(w.dtype)
    prompt_product(w.dtype)
    w = w.contiguous()
    return GemvMatrix(w, gemv.float_product(w))
