"""Python faces of the C products in gemv.c and gemm.c: the weight layouts they read, built once
from the quantized matrices, and the calls, on tensors' data pointers.

Activations are quantized to int8 inside each call, per block of 32 inputs, or per group for
4-bit weights in groups of 128 (`activation_block`; one float32 step a block, the block's
largest magnitude / 127), so each activation is within half its block's step of its value; the
weights' products are exact integer sums, scaled in float32.
"""

from __future__ import annotations

import torch

from astrai.kernels.build import kernel_library, why_absent
from astrai.kernels.huge_pages import contiguous_in_huge_pages

BLOCK = 32  # inputs an activation step covers (8-bit weights; 4-bit: activation_block)
PAIR = 64  # rows are padded to a multiple of these inputs
COLUMNS = 16  # weight rows a column block holds: the outputs of one vector


def activation_block(group: int) -> int:
    """Inputs an activation step covers for 4-bit weights in groups of `group` (gemv.c's
    alloc_activations call): the group where it spans several loads of 64, else BLOCK."""
    return group if group > PAIR else BLOCK


# The products' kinds, as decode_layers.c names them: a run of `_call` carries its kind, its
# weights' pointers and its group (INT4) as `run.spec`, for a caller that calls it from C.
FLOAT32, BFLOAT16, INT8, INT4, PANEL_FLOAT32, PANEL_BFLOAT16 = range(6)

ERRORS = {-1: "a shape it does not take", -2: "out of memory", -3: "an instruction set missing"}


def padded_width(in_features: int) -> int:
    return -(-in_features // PAIR) * PAIR


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """t [out, ...] with zero columns up to `width` and zero rows up to a multiple of COLUMNS."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1], 0, -t.shape[0] % COLUMNS))


def _columns(t: torch.Tensor, piece: int) -> torch.Tensor:
    """[out, width] (out a multiple of COLUMNS) as [out / 16, width / piece, 16, piece]: each
    `piece` inputs of a column block's 16 rows side by side, a line."""
    lines = t.view(-1, COLUMNS, t.shape[1] // piece, piece).transpose(1, 2)
    return contiguous_in_huge_pages(lines)


def _bf16_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).view(torch.int16).contiguous()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int):
    """(nibbles uint8 [out / 16, width / 8, 16, 4], scale and zero bf16 bits int16
    [out / 16, width / group, 16]) from quantize_groups' q (uint8 in [0, 16)), scale and zero;
    width is in rounded up to PAIR and out to COLUMNS, the padding's weights zero. Each 64-byte
    line holds 8 inputs of a block's 16 rows: row r's byte j holds input j in its low nibble and
    input 4 + j in its high one (quantized.h)."""
    in_features = q.shape[1]
    width = padded_width(in_features)
    if width % group:
        raise ValueError(f"group {group} does not divide the padded width {width}")
    q = _pad(q, width).view(-1, width // 8, 2, 4)
    nibbles = _columns((q[:, :, 0] | (q[:, :, 1] << 4)).view(-1, width // 2), 4)

    def columns(t: torch.Tensor) -> torch.Tensor:  # [out, groups] -> [out / 16, groups, 16]
        return _columns(_bf16_bits(_pad(t, width // group)), 1).squeeze(-1)

    return nibbles, columns(scale), columns(zero)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """The int8 [out, in] weights plus 128 (uint8) as [out / 16, width / 4, 16, 4], width in
    rounded up to PAIR and out to COLUMNS, the padding's weights zero: any width."""
    padded = _pad(q, padded_width(q.shape[1]))
    return _columns(padded.view(torch.uint8) ^ 0x80, 4)  # two's complement w + 128


def one_row_ahead(kind: int, on: bool | None = None) -> bool:
    """Whether the passes of products of `kind` (FLOAT32, BFLOAT16, INT8, INT4) at one row
    ask for the weights ahead in software (gemv.c, `astrai_ahead_at_one_row`; timed by
    astrai/infer/ahead.py), set to `on` first unless it is None: the same values either way."""
    return bool(_library().astrai_one_row_ahead(kind, -1 if on is None else int(on)))


def _library():
    lib = kernel_library()
    if lib is None:
        raise RuntimeError(f"our C GEMV kernels are absent: {why_absent()}")
    return lib


def _raise_on(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"the {what} kernel refused the call: {ERRORS.get(code, code)}")


def _call(kernel, what: str, shape: tuple[int, int], weights: tuple, tail: tuple, kind: int):
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
    run.spec = (kind, pointers, tail[0] if kind == INT4 else 0)
    return run


def int4_product(nibbles, scale, zero, group: int, shape: tuple[int, int]):
    """run(x, threads=None, isa=0): x [..., in] @ W.T in float32, W the [out, in] (`shape`)
    4-bit matrix pack_int4 laid out. isa 0 takes the best path here; 1 (AVX2) or 2 (AVX-512
    VNNI) forces one; threads defaults to torch's."""
    kernel = _library().astrai_int4_gemv
    return _call(kernel, "int4", shape, (nibbles, scale, zero), (group,), INT4)


def isa() -> int:
    """The 8- and 4-bit products' best path here: 2 AVX-512 VNNI, 1 AVX2 (0: neither, and
    none runs). The many-row 4-bit product (int4_gemm_product) takes 2 only."""
    return _library().astrai_gemv_isa()


def int4_gemm_product(nibbles, scale, zero, group: int, shape: tuple[int, int]):
    """int4_product's many-row road (gemm.c): the same weights, activations and arguments,
    multiplied as a blocked matrix product; AVX-512 VNNI only (isa 2, or 0 where it is the
    best path here)."""
    kernel = _library().astrai_int4_gemm
    return _call(kernel, "int4 gemm", shape, (nibbles, scale, zero), (group,), INT4)


def int4_dequantize(nibbles, scale, zero, group: int, rows: range, in_features: int, dtype):
    """Rows `rows` of the 4-bit matrix pack_int4 laid out in `nibbles`, as the float32 or
    bfloat16 [len(rows), in] weights they stand for: (q - 8) * scale + zero, scale and zero
    quantize_groups' float32 [out, in // group]."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"4-bit weights dequantize to float32 or bfloat16, not {dtype}")
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in (scale, zero)):
        raise ValueError("scale and zero must be contiguous float32, as quantize_groups makes them")
    if not 0 <= rows.start <= rows.stop <= scale.shape[0] or rows.step != 1:
        raise ValueError(f"rows {rows} of a matrix of {scale.shape[0]}")
    w = torch.empty(len(rows), in_features, dtype=dtype)
    args = (nibbles.data_ptr(), scale.data_ptr(), zero.data_ptr(), group, in_features)
    bf16 = int(dtype == torch.bfloat16)
    n = torch.get_num_threads()
    code = _library().astrai_int4_dequantize(*args, rows.start, rows.stop, w.data_ptr(), bf16, n)
    _raise_on(code, "int4 dequantize")
    return w


FLOAT_AMX = 4  # the float product's path with AMX tiles (float_gemv.c)


def float_isa() -> int:
    """The float product's best path here: 1 AVX2, 2 AVX-512, 3 AVX-512 BF16, 4 AMX."""
    return _library().astrai_float_gemv_isa()


def float_product(weight: torch.Tensor):
    """run(x, threads=None, isa=0): x [..., in] @ W.T in float32 for W = weight, float32 or
    bfloat16 [out, in] as torch holds it (float_gemv.c: in a multiple of 16)."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_contiguous():
        raise ValueError(
            f"the float kernel takes contiguous float32 or bfloat16, not {weight.dtype}"
        )
    kernel = _library().astrai_float_gemv
    shape = tuple(weight.shape)
    bf16 = weight.dtype == torch.bfloat16
    return _call(kernel, "float", shape, (weight,), (int(bf16),), BFLOAT16 if bf16 else FLOAT32)


def panel_product(panels: torch.Tensor, shape: tuple[int, int]):
    """run(x, threads=None): x [..., in] @ W.T for W of `shape` [out, in], float32 or bfloat16,
    laid out by astrai/infer/panels.py (panels.c: in a multiple of 16). In float32, or in
    bfloat16 where x and W are both bfloat16: a bfloat16 prompt's activations and outputs are
    not copied to float32 (the kernel rounds each output once either way, the same bits)."""
    kernel = _library().astrai_panel_product
    out_features, in_features = shape
    bf16 = panels.dtype == torch.bfloat16

    def run(x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        if x.shape[-1] != in_features:  # the kernel reads as many inputs as x has
            raise ValueError(f"x has {x.shape[-1]} features, the panel matrix takes {in_features}")
        io = torch.bfloat16 if bf16 and x.dtype == torch.bfloat16 else torch.float32
        rows = x.reshape(-1, in_features)
        if rows.dtype != io or not rows.is_contiguous():
            rows = rows.to(io).contiguous()
        y = torch.empty(rows.shape[0], out_features, dtype=io)
        n = threads if threads is not None else torch.get_num_threads()
        args = (rows.data_ptr(), rows.shape[0], in_features, panels.data_ptr(), out_features)
        code = kernel(*args, int(bf16), y.data_ptr(), n, int(io == torch.bfloat16))
        _raise_on(code, "panel")
        return y.view(*x.shape[:-1], out_features)

    run.weights = (panels,)
    run.spec = (PANEL_BFLOAT16 if bf16 else PANEL_FLOAT32, (panels.data_ptr(),), 0)
    return run


def int8_product(weight, row_scale, shape: tuple[int, int]):
    """run(x, threads=None, isa=0): x [..., in] @ W.T in float32, W = q * row_scale[:, None]
    of `shape` [out, in] (weight: pack_int8(q))."""
    kernel = _library().astrai_int8_gemv
    scale = torch.nn.functional.pad(row_scale.float(), (0, -len(row_scale) % COLUMNS))
    return _call(kernel, "int8", shape, (weight, scale.contiguous()), (), INT8)
