"""Python faces of the C products in gemv.c: the weight layouts they read, built once from the
quantized matrices, and the calls, on tensors' data pointers.

Activations are quantized to int8 per block of 32 inputs inside each call (one float32 step a
block, the block's largest magnitude / 127), so each activation is within half its block's step
of its value; the weights' products are exact integer sums, scaled in float32.
"""

from __future__ import annotations

import torch

from astrai.kernels.build import gemv_library, why_absent

BLOCK = 32  # inputs an activation step covers
PAIR = 64  # inputs one weight load covers: rows are padded to a multiple of it
ERRORS = {-1: "a shape it does not take", -2: "out of memory", -3: "an instruction set missing"}


def padded_width(in_features: int) -> int:
    return -(-in_features // PAIR) * PAIR


def _pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.shape[1] < width else t


def _bf16_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).view(torch.int16).contiguous()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int):
    """(nibbles uint8 [out, width / 2], scale and zero bf16 bits int16 [out, width / group]) from
    quantize_groups' q (uint8 in [0, 16)), scale and zero; width is in rounded up to PAIR, the
    padding's weights zero. Each PAIR inputs take 32 bytes, byte j holding input j in its low
    nibble and input 32 + j in its high one: one load unpacks into two whole blocks."""
    out_features, in_features = q.shape
    width = padded_width(in_features)
    if width % group:
        raise ValueError(f"group {group} does not divide the padded width {width}")
    q = _pad_columns(q, width).view(out_features, width // PAIR, 2, BLOCK)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(out_features, width // 2).contiguous()
    groups = width // group
    return nibbles, _bf16_bits(_pad_columns(scale, groups)), _bf16_bits(_pad_columns(zero, groups))


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """The int8 [out, in] weights with rows padded (zeros) to a multiple of PAIR: any width."""
    return _pad_columns(q, padded_width(q.shape[1])).contiguous()


def _library():
    lib = gemv_library()
    if lib is None:
        raise RuntimeError(f"our C GEMV kernels are absent: {why_absent()}")
    return lib


def _raise_on(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"the {what} kernel refused the call: {ERRORS.get(code, code)}")


def _call(kernel, what: str, shape: tuple[int, int], weights: tuple, tail: tuple):
    """x [..., in] -> [..., out] float32 through `kernel`, the weights' pointers taken once
    (a call at one row costs a few microseconds of Python, a share of a small matrix's time)."""
    out_features, in_features = shape
    pointers = tuple(w.data_ptr() for w in weights)

    def run(x: torch.Tensor, threads: int | None = None, isa: int = 0) -> torch.Tensor:
        if x.shape[-1] != in_features:  # the kernel reads as many inputs as x has
            raise ValueError(f"x has {x.shape[-1]} features, the {what} matrix takes {in_features}")
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.to(torch.float32).contiguous()
        y = torch.empty(rows.shape[0], out_features)
        n = threads if threads is not None else torch.get_num_threads()
        args = (rows.data_ptr(), rows.shape[0], rows.shape[1], *pointers, out_features, *tail)
        _raise_on(kernel(*args, y.data_ptr(), n, isa), what)
        return y.view(*x.shape[:-1], out_features)

    run.weights = weights  # kept alive as long as the product
    return run


def int4_product(nibbles, scale, zero, group: int, in_features: int):
    """run(x, threads=None, isa=0): x [..., in_features] @ W.T in float32, W the 4-bit matrix
    pack_int4 laid out. isa 0 takes the best path here; 1 (AVX2) or 2 (AVX-512 VNNI) forces
    one; threads defaults to torch's."""
    kernel = _library().astrai_int4_gemv
    shape = (nibbles.shape[0], in_features)
    return _call(kernel, "int4", shape, (nibbles, scale, zero), (group,))


def int8_product(weight, row_scale, in_features: int):
    """run(x, threads=None, isa=0): x [..., in_features] @ W.T in float32, W = weight *
    row_scale[:, None] (weight from pack_int8, row_scale float32)."""
    kernel = _library().astrai_int8_gemv
    weights = (weight, row_scale.float().contiguous())
    return _call(kernel, "int8", (weight.shape[0], in_features), weights, ())
