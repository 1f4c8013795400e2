"""RMSNorm and gated activations in one C call each (pointwise.c), for inference on the CPU.

A decode step runs each of these once or twice a layer on a few rows, where torch's
composite ops cost more than the arithmetic (F.rms_norm ~14 us on 896 values, alone). Taking
them here made a decode step of a 0.5B-shaped model 1.04x (int8 weights) and 1.07x (bfloat16)
faster at batch 1 on a 2-core Intel Xeon. They have no gradient, so they run only where none is recorded and torch is
not tracing; elsewhere the functions return None and torch's ops run (training).
"""

from __future__ import annotations

import torch

from astrai.kernels.build import kernel_library, why_absent

ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}
DTYPES = (torch.float32, torch.bfloat16)


def _takes(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can go through the kernels here: float32 or bfloat16 alike, on a
    CPU where the kernels built, the last dimension a multiple of 8 and contiguous, and nothing
    to differentiate or to trace. (A decode step asks ~75 times: the cheap tests come first.)"""
    first = tensors[0]
    return (
        not torch.is_grad_enabled()
        and first.dtype in DTYPES
        and first.is_cpu
        and first.shape[-1] % 8 == 0
        and all(t.dtype == first.dtype and t.stride(-1) == 1 for t in tensors)
        and not torch.compiler.is_compiling()
        and why_absent() is None
    )


def _row_stride(t: torch.Tensor) -> int | None:
    """The elements between consecutive rows of t [..., n] read as one [rows, n] matrix, or
    None where its leading dimensions are not evenly strided."""
    if t.is_contiguous():
        return t.shape[-1]
    stride = t.stride(-2)
    expected = stride
    for size, step in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1]), strict=True):
        if size != 1 and step != expected:
            return None
        expected *= size
    return stride


def _empty(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor like t (empty_like costs a third of torch.empty with a shape)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """x [..., dim] normalised by its root mean square, times weight (bfloat16: rounded before
    the weight multiplies, as Llama does). With residual (x's shape), (x + residual, the norm
    of that sum). None where the kernel does not take them (see _takes; rows not evenly
    strided)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if weight.shape != x.shape[-1:] or not _takes(*tensors):
        return None
    stride = _row_stride(x)
    if stride is None or (
        residual is not None and (residual.shape != x.shape or _row_stride(residual) != stride)
    ):
        return None
    rows, dim = x.numel() // x.shape[-1], x.shape[-1]
    out = _empty(x)
    total = None if residual is None else _empty(x)
    code = kernel_library().astrai_rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), stride, rows, dim,
        weight.data_ptr(), int(x.dtype == torch.bfloat16), eps,
        None if total is None else total.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _raise_on(code, "RMSNorm")
    return out if residual is None else (total, out)


def gated_activation(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """act(gate) * up (bfloat16: the activation rounded before the product, as torch's two ops
    round), for gate and up [..., n] read with the same row stride (the halves of one fused
    product). None where the kernel does not take them (see _takes), the activation is not one
    it has or the rows are not evenly strided."""
    if act not in ACT_CODES or not _takes(gate, up):
        return None
    stride = _row_stride(gate)
    if stride is None or _row_stride(up) != stride:
        return None
    out = _empty(gate)
    rows, n = gate.numel() // gate.shape[-1], gate.shape[-1]
    code = kernel_library().astrai_gated_activation(
        gate.data_ptr(), up.data_ptr(), stride, rows, n, int(gate.dtype == torch.bfloat16),
        ACT_CODES[act], out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _raise_on(code, "gated activation")
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """logits [B, V] float32 (rows with unit stride) -> [B] int64: the first index of each
    row's maximum (a NaN the largest), as torch's argmax gives it. None where the kernel does
    not take them (any V; no gradient flows through an index)."""
    if (
        logits.dim() != 2
        or logits.dtype != torch.float32
        or not logits.is_cpu
        or logits.stride(-1) != 1
        or torch.compiler.is_compiling()
        or why_absent() is not None
    ):
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel_library().astrai_argmax_rows(
        logits.data_ptr(), *logits.shape, logits.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out


def _raise_on(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"the {what} kernel refused the call: a width not a multiple of 8")
