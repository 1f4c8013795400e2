"""4-bit weights for inference: each row cut into groups of GROUPS[i] consecutive inputs, each
group with its own scale and zero point (16 levels spread over the group's own range), and one
of two products:

- "weight_only": `torch.ops.aten._weight_int4pack_mm_for_cpu`, activations in bfloat16, the
  4-bit weights dequantized inside the kernel (its float32-activation path is ~50x slower);
- "gemv": our C kernel (astrai/kernels/gemv.c), activations quantized to int8 per block of 32
  (of 128 at groups of 128) on each call and integer dot products (AVX-512 VNNI or AVX2), the
  weights streamed once whatever the number of rows. Absent where there is no C compiler or no AVX2.

Which group size multiplies fastest depends on the CPU and the shape, so prepare_params times
each that divides the shape (and each product that runs here, astrai/infer/support.py) at load
and keeps the fastest. docs/inference.md says why no other product is offered.

Past some number of rows (a prompt's), a matrix multiplied by "gemv" takes another road
(`split`, `road`), since gemv streams the weights once but multiplies each row apart: at 2,048
rows of the 0.5B shapes it ran 117-134 GFLOP/s on a 2-core Intel Xeon. The roads:

- "gemm": our blocked product of the same packed weights and int8 activations (gemm.c), where
  AVX-512 VNNI runs: 1,400-1,800 GOP/s on a 2-core AMD Zen 5 at 256-2,048 rows, gemv's 500-700;
- "dense": the weights dequantized from the kernel's packing (gemv.c), a slice of outputs at a
  time, and torch's dense product, in bfloat16 where that is native (`dense_dtype`): on the
  Xeon torch's float32 product ran 307-390 GFLOP/s and the bfloat16 one (AMX) 1,100-1,400.

prepare_params measures which road, and from how many rows, pays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from astrai.hardware import native_bf16
from astrai.infer.quant import by_rows
from astrai.kernels import gemv
from astrai.model.layers import cast

KERNELS = ("weight_only", "gemv")
GROUPS = (32, 64, 128)  # the group sizes measured; the kernel takes these (and 256)
LEVELS = 16
MIDDLE = 8  # the kernel's weight is (q - MIDDLE) * scale + zero, q in [0, LEVELS)
# a scale at least this fraction of its group's middle value, so that the zero point's bf16
# rounding (at most 2**-9 of it) moves the 16 levels by at most a quarter of a step
OFFSET_FRACTION = 2.0**-7
ROW_BLOCK = 16  # the kernel's packing takes a multiple of 16 output rows


@dataclass(frozen=True, eq=False)
class Int4Matrix:
    """W [out, in] ~= (q - 8) * scale + zero per group of `group` inputs; `linear(x)` is x @ W.T
    in x's dtype."""

    packed: torch.Tensor  # the product's packing of q (uint8, two weights a byte)
    scale: torch.Tensor  # float32 [out, in // group], each a bfloat16 value
    zero: torch.Tensor  # float32 [out, in // group], each a bfloat16 value
    group: int
    kernel: str  # one of KERNELS
    run: Callable[[torch.Tensor], torch.Tensor]  # x [..., in] -> [..., out], the chosen product
    split: int | None = None  # gemv: inputs of more rows than this take `road`
    road: str = "dense"  # one of ROADS

    @property
    def product(self) -> str:
        name = f"int4 {self.kernel}/{self.group}"
        return name if self.split is None else f"{name} up to {self.split} rows, then {self.road}"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.scale.shape[0], self.scale.shape[1] * self.group))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return cast(self.run(x), x.dtype)


def _round_up_bf16(v: torch.Tensor) -> torch.Tensor:
    """The float32 values as bfloat16 values no smaller than them (v >= 0)."""
    return (v * (1 + 2.0**-8)).to(torch.bfloat16).float()


def quantize_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric 4 bits per group of `group` inputs: (q uint8 [out, in] in [0, 16), scale and
    zero float32 [out, in // group]) with W ~= (q - 8) * scale + zero. scale and zero are
    bfloat16 values (the kernel reads them so), and every weight is within half a step (its
    group's scale / 2) of its level."""
    out_features, in_features = w.shape
    if in_features % group:
        raise ValueError(f"in_features {in_features} is not a multiple of the group {group}")
    g = w.float().view(out_features, in_features // group, group)
    low, high = g.amin(-1), g.amax(-1)
    middle = (low + high) / 2
    spread = torch.maximum((high - low) / (LEVELS - 1), middle.abs() * OFFSET_FRACTION)
    scale = _round_up_bf16(spread.clamp_min(torch.finfo(torch.bfloat16).tiny))
    # levels centred on the group's middle: zero - scale / 2 is the centre of the 16
    zero = (middle + scale / 2).to(torch.bfloat16).float()
    q = torch.round((g - zero[..., None]) / scale[..., None]) + MIDDLE
    q = q.clamp_(0, LEVELS - 1).to(torch.uint8).view(out_features, in_features)
    return q, scale, zero


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 [out, in] matrix the 4-bit values stand for."""
    out_features, in_features = q.shape
    groups = scale.shape[1]
    levels = q.float().view(out_features, groups, in_features // groups) - MIDDLE
    return (levels * scale[..., None] + zero[..., None]).view(out_features, in_features)


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > len(t) else t


def _weight_only(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int):
    out_features = q.shape[0]
    # the kernel packs outputs in blocks of ROW_BLOCK: zero rows fill the last, and are cut
    rows = -(-out_features // ROW_BLOCK) * ROW_BLOCK
    q, scale, zero = (_padded_rows(t, rows) for t in (q, scale, zero))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    # [in // group, out, 2]: the kernel's layout of the scales and zero points
    scales_zeros = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()

    def run(x: torch.Tensor) -> torch.Tensor:  # the kernel takes two dimensions only
        flat = x.to(torch.bfloat16).flatten(0, -2)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group, scales_zeros)
        if rows != out_features:
            y = y[:, :out_features]
        return y.reshape(*x.shape[:-1], out_features)

    return packed, run


def _gemv(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int):
    nibbles, scale_bits, zero_bits = gemv.pack_int4(q, scale, zero, group)
    return nibbles, gemv.int4_product(nibbles, scale_bits, zero_bits, group, tuple(q.shape))


BUILDERS = {"weight_only": _weight_only, "gemv": _gemv}
DENSE_CHUNK = 1 << 22  # weights dequantized at a time: 8 MB in bfloat16, held in L2 or L3


@functools.cache  # asked on every dense call; the answer is the process's
def dense_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the dense road multiplies `dtype` activations in: bfloat16 for float32 ones
    where the CPU multiplies it natively (4x float32's rate with AMX). Rounding activations
    and dequantized weights to bfloat16 (2^-9 of each) stays within what the 4-bit levels and
    gemv's int8 activation levels already round off."""
    if dtype == torch.float32 and native_bf16(device):
        return torch.bfloat16
    return dtype


def _dense(gemv_run, scale, zero, group: int, shape) -> Callable:
    """x @ W.T through W dequantized (exactly `dequantize`'s values, rounded to dense_dtype), by
    gemv.c's dequantizer from the nibbles gemv_run reads, DENSE_CHUNK weights at a time, and
    torch's product."""
    nibbles = gemv_run.weights[0]
    out_features, in_features = shape
    chunks = -(-out_features * in_features // DENSE_CHUNK)
    step = -(-out_features // chunks)  # output rows a chunk: even, so no thin last chunk

    def run(x: torch.Tensor) -> torch.Tensor:
        dtype = dense_dtype(x.dtype, x.device)
        # float16 models: the dequantizer writes float32 and bfloat16, torch rounds on
        weights_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        rows_in = x.reshape(-1, in_features).to(dtype)
        y = torch.empty(rows_in.shape[0], out_features, dtype=dtype)
        for first in range(0, out_features, step):
            rows = range(first, min(first + step, out_features))
            w = gemv.int4_dequantize(nibbles, scale, zero, group, rows, in_features, weights_dtype)
            torch.mm(rows_in, w.to(dtype).T, out=y[:, first : rows.stop])  # in place: no cat
        return y.view(*x.shape[:-1], out_features)

    return run


def _gemm(gemv_run, scale, zero, group: int, shape) -> Callable:
    """x @ W.T by gemm.c's blocked product of the weights gemv_run reads."""
    return gemv.int4_gemm_product(*gemv_run.weights, group, shape)


# what a gemv matrix's inputs past its split take: road(gemv's run, scale, zero, group, shape)
ROADS = {"dense": _dense, "gemm": _gemm}


def int4_matrix(
    w: torch.Tensor, kernel: str, group: int, split: int | None = None, road: str = "dense"
) -> Int4Matrix:
    """w [out, in] in 4 bits, groups of `group` inputs, multiplied by `kernel`'s product; with
    split (gemv only), inputs of more rows than that by `road` (one of ROADS)."""
    if kernel not in BUILDERS:
        raise ValueError(f"unknown int4 kernel {kernel!r}; one of {', '.join(KERNELS)}")
    if group not in GROUPS:
        raise ValueError(f"int4 group must be one of {GROUPS}, got {group}")
    if split is not None and kernel != "gemv":
        raise ValueError(f"only the gemv int4 product splits by rows, not {kernel!r}")
    if road not in ROADS:
        raise ValueError(f"unknown int4 road {road!r}; one of {', '.join(ROADS)}")
    q, scale, zero = quantize_groups(w, group)
    packed, run = BUILDERS[kernel](q, scale, zero, group)
    if split is not None:
        run = by_rows(run, ROADS[road](run, scale, zero, group, tuple(w.shape)), split)
    return Int4Matrix(packed, scale, zero, group, kernel, run, split, road)


def groups_for(in_features: int) -> list[int]:
    """The group sizes of GROUPS that divide in_features."""
    return [group for group in GROUPS if in_features % group == 0]
