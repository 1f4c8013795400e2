"""A decode step's layers in one C call (astrai/kernels/decode_layers.c), for models whose every
layer it runs: a plain pre-norm GQA decoder (fused q/k/v and gate/up products, SwiGLU or GeGLU,
RoPE over whole heads or none), each matrix one of our C products at the call's rows or a
plain float tensor, which our float product takes (from an [out, in] copy where it is stored
[in, out], for a small model: COPY_BYTES). A chunk of a few tokens a sequence
(speculated tokens to verify, a short prompt) goes the same way, each real token a row of the
call.

The C function calls the kernels the Python path calls, in the same order with the same
roundings, so where every matrix is one of our products a decode step's hidden states are bit
for bit the same (tests/infer/test_fused_layers.py; a plain tensor, which the Python path
multiplies with torch's product, differs by its roundings); it saves the Python and dispatch
around them, ~140 us a layer (docs/inference.md). Where a model, its prepared weights or a
chunk are not ones it takes, `fused_layers` returns None and the layers run in Python.

The layers' C structures are built once per prepared params and kept while the same weights
sit under the same keys (weak references: the plan keeps no model alive).
"""

from __future__ import annotations

import ctypes
import math
import weakref
from dataclasses import dataclass

import torch

from astrai.config import ModelConfig
from astrai.infer.float_gemv import GemvMatrix, kernel_rows, sure_rows
from astrai.kernels import gemv
from astrai.kernels.build import kernel_library, why_absent
from astrai.kernels.pointwise import ACT_CODES
from astrai.model.layers import cast
from astrai.model.params import Params
from astrai.model.rope import rope_tables

ERRORS = {
    1: "a product kind it lacks",
    2: "a product refused its shape",
    3: "attention refused the pages",
    4: "an RMSNorm refused its width",
    5: "the activation refused its width",
    6: "out of memory",
}
# The most tokens of one sequence a call takes: speculated tokens to verify, a short prompt.
# Each attends over the pages alone (attention.c, one query a row), where a longer prompt's
# attention is torch's fused kernels' work.
CHUNK_TOKENS = 16
PLANS_KEPT = 8  # prepared models whose plans are kept (an Engine's target and draft, tests)
# A float matrix stored [in, out] (prepare_params' "columns" layout, where torch's product timed
# fastest alone: small matrices, a draft's) is copied [out, in] for the C products, up to this
# many bytes a model: one call removes most of a small model's step (a 128-wide 4-layer
# draft's: 0.58 -> 0.24 ms), where doubling a large model's matrices would cost its memory.
COPY_BYTES = 64 << 20
FLOAT_DTYPES = (torch.float32, torch.bfloat16)  # of the activations, the pool, plain matrices
_int, _float, _ptr, _i64 = ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64


class _Matrix(ctypes.Structure):
    _fields_ = [("kind", _int), ("in_", _int), ("out", _int), ("group", _int)] + [
        (name, _ptr) for name in ("weight", "scale", "zero", "bias")
    ]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _ptr), ("mlp_norm", _ptr)]
    _fields_ += [(name, _Matrix) for name in ("qkv", "o", "gate_up", "down")]
    _fields_ += [("rotates", _int)]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, _int) for name in ("layers", "rows", "hidden", "heads", "kv_heads", "dim")),
        *((name, _int) for name in ("intermediate", "bf16", "act", "threads")),
        ("eps", _float), ("scale", _float), ("cos", _ptr), ("sin", _ptr),
        ("slots", _ptr), ("table", _ptr), ("keys", _ptr),
        *((name, _int) for name in ("width", "pool_bf16", "pages", "page_size")),
        ("k", _ptr), ("v", _ptr), ("layer_bytes", _i64), ("final_norm", _ptr),
    ]  # fmt: skip


@dataclass(frozen=True, eq=False)
class _Plan:
    layers: ctypes.Array  # of _Layer, pointing into the weights
    rows: float  # the most rows every product runs in C at
    dtype: torch.dtype  # of the activations and norms
    intermediate: int
    final_norm: int  # its pointer
    copies: tuple[torch.Tensor, ...]  # [out, in] copies of matrices stored [in, out]


@dataclass(frozen=True, eq=False)
class _Kept:
    cfg: ModelConfig
    keys: tuple[str, ...]
    refs: tuple[weakref.ref, ...]
    plan: _Plan | None

    def holds(self, params: Params, cfg: ModelConfig) -> bool:
        """Whether params still hold, under the plan's keys, the objects it was built from."""
        return self.cfg is cfg and all(
            params.get(key) is ref() for key, ref in zip(self.keys, self.refs, strict=True)
        )


_kept: dict[int, _Kept] = {}


def takes_model(cfg: ModelConfig) -> bool:
    """Whether the C layers run this model's layers (its prepared weights are asked later)."""
    return (
        cfg.attn_type == "gqa"
        and cfg.model_type == "decoder"
        and cfg.norm_placement == "pre"
        and not (cfg.use_gated_attention or cfg.use_qk_norm or cfg.rms_norm_unit_offset)
        and cfg.residual_multiplier == 1.0
        and cfg.attn_logit_softcapping is None
        and not cfg.has_sliding_layers
        and cfg.partial_rotary_factor == 1.0
        and cfg.hidden_act in ACT_CODES
        and not any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        and cfg.dim_per_head % 8 == 0
        and cfg.hidden_size % 8 == 0
    )


NORMS = ("input_layernorm", "post_attention_layernorm")
MATRICES = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj"}
MATRICES |= {"gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"}


def _keys(cfg: ModelConfig) -> tuple[str, ...]:
    """The keys of every param a plan reads (biases included, present or not)."""
    keys = ["model.norm.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        keys += [f"{p}.{norm}.weight" for norm in NORMS]
        keys += [f"{p}.{m}.{part}" for m in MATRICES.values() for part in ("weight", "bias")]
    return tuple(keys)


def _c_product(matrix) -> tuple[tuple, float] | None:
    """(the spec of the C product `matrix` runs a few rows through, the most rows it does), or
    None. A plain float tensor kept [out, in] (the "rows" layout) runs our float product here,
    up to the rows it matched torch's at everywhere (float_gemv.sure_rows): in one call there is
    no Python around it to weigh."""
    if isinstance(matrix, torch.Tensor):
        plain = matrix.dim() == 2 and matrix.is_cpu and matrix.is_contiguous()
        if not plain or matrix.dtype not in FLOAT_DTYPES or matrix.shape[1] % 16:
            return None
        return gemv.float_product(matrix).spec, sure_rows(matrix.dtype)
    if isinstance(matrix, GemvMatrix):
        return matrix.run.spec, kernel_rows(matrix.weight.dtype)
    run, rows = getattr(matrix, "run", None), math.inf
    if hasattr(run, "few"):  # quant.by_rows: a C product up to `rows`, another beyond
        run, rows = run.few, run.rows
    return (run.spec, rows) if hasattr(run, "spec") else None


def _stored_by_columns(matrix) -> bool:
    """Whether `matrix` is a float [out, in] view of [in, out]-contiguous storage."""
    return (
        isinstance(matrix, torch.Tensor)
        and matrix.dim() == 2
        and matrix.dtype in FLOAT_DTYPES
        and matrix.is_cpu
        and not matrix.is_contiguous()
        and matrix.T.is_contiguous()
    )


def _matrix(params: Params, key: str, dtype: torch.dtype, copies: list[torch.Tensor]):
    """(the _Matrix of params[f"{key}.weight"], the most rows it runs in C) or None. A matrix
    stored [in, out] is multiplied from an [out, in] copy, appended to `copies`, while they
    stay within COPY_BYTES."""
    matrix, bias = params.get(f"{key}.weight"), params.get(f"{key}.bias")
    if _stored_by_columns(matrix):
        if sum(c.nbytes for c in copies) + matrix.nbytes > COPY_BYTES:
            return None
        matrix = matrix.contiguous()
        copies.append(matrix)
    found = None if matrix is None else _c_product(matrix)
    if found is None:
        return None
    (kind, pointers, group), rows = found
    out, in_ = matrix.shape
    if bias is not None and not (_usable(bias, dtype) and bias.shape == (out,)):
        return None
    scale, zero = (*pointers[1:], None, None)[:2]
    bias = None if bias is None else bias.data_ptr()
    return _Matrix(kind, in_, out, group, pointers[0], scale, zero, bias), rows


def _shapes_fit(layer: _Layer, cfg: ModelConfig, mlp: int) -> bool:
    """Whether the layer's matrices are the [out, in] the C layers expect of this model, the
    MLP `mlp` wide (a multiple of 8, as the activation kernel takes)."""
    hidden, q = cfg.hidden_size, cfg.num_attention_heads * cfg.dim_per_head
    qkv = q + 2 * cfg.kv_heads * cfg.dim_per_head
    shapes = [(layer.qkv, qkv, hidden), (layer.o, hidden, q)]
    shapes += [(layer.gate_up, 2 * mlp, hidden), (layer.down, hidden, mlp)]
    return mlp % 8 == 0 and all((m.out, m.in_) == (out, in_) for m, out, in_ in shapes)


def _usable(t, dtype: torch.dtype) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == dtype and t.is_cpu and t.is_contiguous()


def _plan(params: Params, cfg: ModelConfig, dtype: torch.dtype) -> _Plan | None:
    """The C structures of the layers, or None where a norm or a product is not one they take."""
    layers, rows = (_Layer * cfg.num_hidden_layers)(), math.inf
    intermediate, copies = None, []
    for i, layer in enumerate(layers):
        p = f"model.layers.{i}"
        norms = [params.get(f"{p}.{norm}.weight") for norm in NORMS]
        if not all(_usable(n, dtype) for n in norms):
            return None
        layer.attn_norm, layer.mlp_norm = (n.data_ptr() for n in norms)
        layer.rotates = int(i not in cfg.nope_layers)
        for name, key in MATRICES.items():
            if (found := _matrix(params, f"{p}.{key}", dtype, copies)) is None:
                return None
            setattr(layer, name, found[0])
            rows = min(rows, found[1])
        width = layer.gate_up.out // 2
        if intermediate not in (None, width) or not _shapes_fit(layer, cfg, width):
            return None  # one MLP width for every layer: the step's buffers are sized once
        intermediate = width
    final = params.get("model.norm.weight")
    if not _usable(final, dtype) or kernel_library() is None:
        return None
    return _Plan(layers, rows, dtype, intermediate, final.data_ptr(), tuple(copies))


def _kept_plan(params: Params, cfg: ModelConfig, dtype: torch.dtype) -> _Plan | None:
    kept = _kept.get(id(params))
    if kept is not None and kept.holds(params, cfg):
        return kept.plan if kept.plan is None or kept.plan.dtype == dtype else None
    keys = _keys(cfg)
    refs = tuple(weakref.ref(params[k]) if k in params else _absent for k in keys)
    plan = _plan(params, cfg, dtype)
    if len(_kept) >= PLANS_KEPT:
        _kept.pop(next(iter(_kept)))
    _kept[id(params)] = _Kept(cfg, keys, refs, plan)
    return plan


def _absent() -> None:
    """The reference of a key params lack: it holds while they still lack it."""


def fused_layers(
    params: Params,
    cfg: ModelConfig,
    pool: dict,
    x: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor | None,
) -> torch.Tensor | None:
    """Every layer and the final norm over a batch of chunks: embedded tokens x [B, T, hidden]
    at positions [B, T], the real ones (valid [B, T], None: all) written to the pool at their
    slots (int64, one per real token in order), each attending over its row's pages (table
    [B, W] int64) up to its own position. Returns the final normed hidden [B, T, hidden], a
    padded position's that of its row's last real one; None where the model, its weights or
    the chunk (more than CHUNK_TOKENS a sequence, more tokens in all than its products run in
    C at) are not ones the C layers take, and the caller runs the layers itself. Each real
    token is a row of the C call: a decode step has one a sequence, a chunk of a prompt or of
    speculated tokens several."""
    B, T = positions.shape
    if T > CHUNK_TOKENS or torch.is_grad_enabled() or not takes_model(cfg) or why_absent():
        return None
    plan = _kept_plan(params, cfg, x.dtype)
    rows, k, v = slots.numel(), pool["k"], pool["v"]
    if plan is None or rows > plan.rows or not _pool_fits(k, v):
        return None
    positions = cast(positions, torch.long)
    if valid is None:
        x, positions = x.reshape(rows, -1), positions.reshape(rows)
        table = table if T == 1 else table.repeat_interleave(T, 0)
    else:
        x, positions = x[valid], positions[valid]
        table = table[torch.arange(B, device=table.device)[:, None].expand(B, T)[valid]]
    out = _run(plan, cfg, k, v, x.contiguous(), positions, table.contiguous(), slots.contiguous())
    if valid is None:
        return out.view(B, T, -1)
    counts = valid.sum(1)  # each padded position reads its row's last real token's row
    first = counts.cumsum(0) - counts
    return out[first[:, None] + (valid.cumsum(1) - 1).clamp(min=0)]


def _pool_fits(k: torch.Tensor, v: torch.Tensor) -> bool:
    return k.dtype in FLOAT_DTYPES and k.is_cpu and k.is_contiguous() and v.is_contiguous()


def _run(plan: _Plan, cfg: ModelConfig, k, v, x, positions, table, slots) -> torch.Tensor:
    """The C call over x [rows, hidden] at positions [rows], row r attending over the pages
    table[r] up to its position: the final normed hidden [rows, hidden]."""
    rows = x.shape[0]
    out = torch.empty_like(x)
    keys = positions + 1
    cos, sin = (t.contiguous() for t in rope_tables(cfg, positions))
    step = _Step(
        layers=cfg.num_hidden_layers, rows=rows, hidden=cfg.hidden_size,
        heads=cfg.num_attention_heads, kv_heads=cfg.kv_heads, dim=cfg.dim_per_head,
        intermediate=plan.intermediate, bf16=int(x.dtype == torch.bfloat16),
        act=ACT_CODES[cfg.hidden_act], threads=torch.get_num_threads(), eps=cfg.rms_norm_eps,
        scale=cfg.attention_scale or cfg.dim_per_head**-0.5, cos=cos.data_ptr(),
        sin=sin.data_ptr(), slots=slots.data_ptr(), table=table.data_ptr(),
        keys=keys.data_ptr(), width=table.shape[1],
        pool_bf16=int(k.dtype == torch.bfloat16), pages=k.shape[1], page_size=k.shape[2],
        k=k.data_ptr(), v=v.data_ptr(), layer_bytes=k[0].numel() * k.element_size(),
        final_norm=plan.final_norm,
    )  # fmt: skip
    code = kernel_library().astrai_decode_layers(
        plan.layers, ctypes.byref(step), x.data_ptr(), out.data_ptr()
    )
    if code:
        raise RuntimeError(f"the decode layers kernel refused the step: {ERRORS.get(code, code)}")
    return out
