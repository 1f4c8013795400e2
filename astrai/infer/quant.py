"""8-bit weights for inference: one int8 matrix and one scale per output channel, with one of
three products:

- "weight_only": `torch._weight_int8pack_mm`, activations in bfloat16, weights dequantized
  inside the kernel;
- "dynamic": fbgemm's `quantized::linear_dynamic`, activations quantized to 8 bits per call
  and an integer product;
- "gemv": our C kernel (astrai/kernels/gemv.c), activations quantized to int8 per block of 32
  inputs on each call (each row on its own), integer dot products (AVX-512 VNNI or AVX2), the
  weights streamed once whatever the number of rows. Absent without a C compiler or AVX2.

Which one wins depends on the CPU (VNNI, AMX, AVX2 only), on the shape and on the number of
rows, so prepare_params times those that run here (astrai/infer/support.py) for each shape at
load, and keeps the faster; where one wins at few rows and another at many, a matrix keeps
both (`split`): measured on a 2-core Zen 5 (two threads, the 0.5B shapes streamed from
memory), "gemv" read 40-52 GB/s at one row where fbgemm's "dynamic" read 28-37, and 7.5-12 at
16 rows where "dynamic" read 9-22.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from astrai.hardware import cpu_flags
from astrai.kernels import gemv
from astrai.model.layers import cast

KERNELS = ("weight_only", "dynamic", "gemv")


@dataclass(frozen=True, eq=False)
class Int8Matrix:
    """W [out, in] ~= weight * scale[:, None]; `linear(x)` is x @ W.T in x's dtype."""

    weight: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out]
    kernel: str  # one of KERNELS
    run: Callable[[torch.Tensor], torch.Tensor]  # x [..., in] -> [..., out], the chosen product
    split: tuple[int, str] | None = None  # (rows, other): `other` runs inputs of more rows

    @property
    def product(self) -> str:
        if self.split is None:
            return self.kernel
        return f"{self.kernel} up to {self.split[0]} rows, then {self.split[1]}"

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return cast(self.run(x), x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale[:, None]


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [out, in], scale float32 [out])."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _weight_only(q: torch.Tensor, scale: torch.Tensor) -> Callable:
    scale_bf16 = scale.to(torch.bfloat16)

    def run(x: torch.Tensor) -> torch.Tensor:  # the kernel takes two dimensions only
        rows = x.to(torch.bfloat16).flatten(0, -2)
        return torch._weight_int8pack_mm(rows, q, scale_bf16).view(*x.shape[:-1], q.shape[0])

    return run


def _reduce_range() -> bool:
    """fbgemm keeps 7-bit activations unless it sums u8 x s8 pairs in 32 bits (VNNI): without
    it the 16-bit intermediate sums could saturate. FBGEMM_ENABLE_INSTRUCTIONS holds fbgemm to
    an instruction set below the CPU's (AVX2, AVX512), and then to its saturating sums."""
    held = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS")
    if held and "VNNI" not in held.upper():
        return True
    return not (cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


# The C++ entry of the op: its Python wrapper looks through every argument for fake script
# objects (the packed weight is a script object), a cost the size of the product at one row.
_LINEAR_DYNAMIC = getattr(
    torch.ops.quantized.linear_dynamic.default, "_op", torch.ops.quantized.linear_dynamic
)


def _dynamic(q: torch.Tensor, scale: torch.Tensor) -> Callable:
    if q.device.type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
        raise RuntimeError("fbgemm is not available")
    zeros = torch.zeros_like(scale, dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated; a failure skips this
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
    packed = torch.ops.quantized.linear_prepack(qweight, None)
    reduce_range = _reduce_range()
    # any leading shape: the activations' one scale is per tensor, so rows need no flattening
    return lambda x: _LINEAR_DYNAMIC(x.float(), packed, reduce_range)


def _gemv(q: torch.Tensor, scale: torch.Tensor) -> Callable:
    return gemv.int8_product(gemv.pack_int8(q), scale, tuple(q.shape))


BUILDERS = {"weight_only": _weight_only, "dynamic": _dynamic, "gemv": _gemv}


def int8_matrix(w: torch.Tensor, kernel: str, split: tuple[int, str] | None = None) -> Int8Matrix:
    """w [out, in] in 8 bits, multiplied by `kernel`'s product (one of KERNELS); with a split
    (rows, other), by `kernel`'s for inputs of up to that many rows and by `other`'s beyond
    (each keeps its own copy of the weights)."""
    for name in (kernel,) if split is None else (kernel, split[1]):
        if name not in BUILDERS:
            raise ValueError(f"unknown int8 kernel {name!r}; one of {', '.join(KERNELS)}")
    q, scale = quantize_rows(w)
    run = BUILDERS[kernel](q, scale)
    if split is None:
        return Int8Matrix(q, scale, kernel, run)
    rows, other = split
    return Int8Matrix(q, scale, kernel, by_rows(run, BUILDERS[other](q, scale), rows), split)


def by_rows(few: Callable, many: Callable, rows: int) -> Callable:
    """x -> few(x) for inputs of up to `rows` rows, many(x) beyond (both kept as attributes,
    with `rows`, for a caller that asks which runs)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        return few(x) if x.numel() <= rows * x.shape[-1] else many(x)

    run.few, run.many, run.rows = few, many, rows
    return run
