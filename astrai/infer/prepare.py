"""prepare_params: the canonical weights turned, once, into the form that decodes fastest on
the running machine. Every choice in it is measured here at load, never assumed from another
machine: the layout of float32 matrices, and with `quantize="int8"` the 8-bit product."""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F

from astrai.infer.quant import int8_matrix

Params = dict[str, torch.Tensor]
log = logging.getLogger("astrai.infer")

EMBED_KEY = "model.embed_tokens.weight"
QUANTIZE = ("int8",)


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """The same matrix as a transposed view of [in, out]-contiguous storage."""
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


def _time_linear(w: torch.Tensor, calls: int = 5) -> float:
    x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
    F.linear(x, w)
    start = time.perf_counter()
    for _ in range(calls):
        F.linear(x, w)
    return time.perf_counter() - start


@functools.cache
def _columns_win(out_features: int, in_features: int, threads: int) -> bool:
    """Whether a float32 [out, in] matrix stored [in, out]-contiguous multiplies one row faster
    here. It won 2x on an AVX2 machine and nothing on an AMX one, so it is measured (best of
    three rounds of each, alternating)."""
    w = torch.randn(out_features, in_features)
    wt = _transposed(w)
    rows = min(_time_linear(w) for _ in range(3))
    cols = min(_time_linear(wt) for _ in range(3))
    log.info(
        "float32 %dx%d: %s layout (rows %.3f ms, columns %.3f ms per 5 calls)",
        out_features,
        in_features,
        "columns" if cols < rows else "rows",
        rows * 1e3,
        cols * 1e3,
    )
    return cols < rows


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


def _float_layout(w: torch.Tensor) -> torch.Tensor:
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return w
    return _transposed(w) if _columns_win(*w.shape, torch.get_num_threads()) else w


def prepare_params(params: Params, quantize: str | None = None) -> Params:
    """The same weights laid out for fast decoding: a new params dict with the same keys, for
    inference only (train on the canonical params).

    Each float32 CPU matrix is kept [out, in] or stored [in, out]-contiguous, whichever
    multiplies one row faster on this machine (measured once per shape and cached). With
    `quantize="int8"` the matrices of the layers and the head become Int8Matrix values (8-bit
    weights, one scale per output channel, the fastest int8 product measured here); the
    embedding and the norms keep their dtype. With tied embeddings the head gets its own copy,
    so the embedding lookup keeps reading whole rows.
    """
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE} or None, got {quantize!r}")
    prepare = int8_matrix if quantize == "int8" else _float_layout
    prepared = {key: prepare(w) if _is_matrix(key, w) else w for key, w in params.items()}
    if "lm_head.weight" not in params and EMBED_KEY in params:
        prepared["lm_head.weight"] = prepare(params[EMBED_KEY])
    return prepared
