"""prepare_params: the canonical weights turned, once, into the form that decodes fastest on
the running machine. Every choice in it is measured here at load, never assumed from another
machine: the layout of float32 matrices, and with `quantize="int8"` the 8-bit product."""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter

import torch
import torch.nn.functional as F

from astrai.infer.quant import int8_matrix
from astrai.model.layers import FUSED

Params = dict[str, torch.Tensor]
log = logging.getLogger("astrai.infer")

EMBED_KEY = "model.embed_tokens.weight"
QUANTIZE = ("int8",)
SWEEP_BYTES = 256 << 20  # scratch for timing the layouts of one shape


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """The same matrix as a transposed view of [in, out]-contiguous storage."""
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


def _sweep(matrices: list[torch.Tensor], x: torch.Tensor) -> float:
    start = time.perf_counter()
    for w in matrices:
        F.linear(x, w)
    return time.perf_counter() - start


@functools.cache
def _columns_win(out_features: int, in_features: int, copies: int, threads: int) -> bool:
    """Whether float32 [out, in] matrices stored [in, out]-contiguous multiply one row faster
    here. It won 2x on an AVX2 machine and nothing on an AMX one, so it is measured, the way a
    decode step reads the matrices (streamed one after the other, not one read again from
    cache): one pass over `copies` matrices of the shape (as many as the model has), best of
    three alternating rounds."""
    rows = [torch.full((out_features, in_features), 0.01) for _ in range(copies)]
    cols = [_transposed(w) for w in rows]
    x = torch.full((1, in_features), 0.5)
    _sweep(rows, x), _sweep(cols, x)
    t_rows = t_cols = float("inf")
    for _ in range(3):
        t_rows, t_cols = min(t_rows, _sweep(rows, x)), min(t_cols, _sweep(cols, x))
    log.info(
        "float32 %dx%d (x%d): %s layout (rows %.3f ms, columns %.3f ms a pass)",
        out_features,
        in_features,
        copies,
        "columns" if t_cols < t_rows else "rows",
        t_rows * 1e3,
        t_cols * 1e3,
    )
    return t_cols < t_rows


def _is_matrix(key: str, w) -> bool:
    """A weight the model multiplies through `project` (the router of a mixture of experts and
    the stacked expert tensors are multiplied otherwise, and stay as they are)."""
    return (
        isinstance(w, torch.Tensor)
        and w.dim() == 2
        and key.endswith(".weight")
        and key != EMBED_KEY
        and not key.endswith(".mlp.gate.weight")
    )


def _float_layouts(matrices: list[torch.Tensor]) -> dict[torch.Size, bool]:
    """{shape: whether the columns layout wins} for the float32 CPU matrices among these."""
    shapes = Counter(w.shape for w in matrices if _is_float_cpu(w))
    threads = torch.get_num_threads()
    # enough matrices to stream as the model does, within SWEEP_BYTES of scratch
    copies = {
        shape: min(n, max(1, SWEEP_BYTES // (4 * shape.numel()))) for shape, n in shapes.items()
    }
    return {shape: _columns_win(*shape, copies[shape], threads) for shape in shapes}


def _is_float_cpu(w) -> bool:
    return isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.device.type == "cpu"


def fuse_projections(params: Params) -> Params:
    """A new dict in which each group of FUSED sibling matrices (and their biases, when all
    have one) is one matrix, the parts stacked by output rows in the order listed."""
    fused = dict(params)
    for key in params:
        for name, parts in FUSED.items():
            suffix = f".{parts[0]}.weight"
            if not key.endswith(suffix):
                continue
            prefix = key.removesuffix(suffix)
            weights = [params.get(f"{prefix}.{part}.weight") for part in parts]
            biases = [params.get(f"{prefix}.{part}.bias") for part in parts]
            if not all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in weights):
                continue
            if any(b is not None for b in biases) and not all(b is not None for b in biases):
                continue
            for part in parts:
                fused.pop(f"{prefix}.{part}.weight")
                fused.pop(f"{prefix}.{part}.bias", None)
            fused[f"{prefix}.{name}.weight"] = torch.cat(weights)
            if biases[0] is not None:
                fused[f"{prefix}.{name}.bias"] = torch.cat(biases)
    return fused


def prepare_params(params: Params, quantize: str | None = None) -> Params:
    """The same weights laid out for fast decoding: a new params dict for inference only (train
    on the canonical params; merge LoRA adapters into the weights first).

    Sibling projections that read the same input are fused (see astrai.model.layers.FUSED): q, k and v into
    `qkv_proj`, gate and up into `gate_up_proj`. Each float32 CPU matrix is kept [out, in] or
    stored [in, out]-contiguous, whichever multiplies one row faster on this machine (measured
    once per shape and cached). With `quantize="int8"` the matrices of the layers and the head
    become Int8Matrix values (8-bit weights, one scale per output channel, the fastest int8
    product measured here); the embedding and the norms keep their dtype. With tied
    embeddings a head laid out otherwise is a copy of its own, so the embedding lookup keeps
    reading whole rows.
    """
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE} or None, got {quantize!r}")
    params = fuse_projections(params)
    if "lm_head.weight" not in params and EMBED_KEY in params:
        params["lm_head.weight"] = params[EMBED_KEY]  # laid out (a copy) as a matrix below
    matrices = {key: w for key, w in params.items() if _is_matrix(key, w)}
    if quantize == "int8":
        return params | {key: int8_matrix(w) for key, w in matrices.items()}
    columns = _float_layouts(list(matrices.values()))
    for key, w in matrices.items():
        if _is_float_cpu(w) and columns[w.shape]:
            params[key] = _transposed(w)
    return params
