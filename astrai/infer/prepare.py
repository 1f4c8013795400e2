"""prepare_params: the canonical weights turned, once, into the form that decodes fastest on
the running machine. Every choice in it is measured here at load, never assumed from another
machine, among the products this machine runs (astrai/infer/support.py): the layout of float
matrices, with `quantize="int8"` the 8-bit product, with `quantize="int4"` the 4-bit product and
its group size."""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter

import torch

from astrai.infer import int4
from astrai.infer.allocator import keep_freed_memory
from astrai.infer.layouts import LAYOUTS
from astrai.infer.packed import DTYPES
from astrai.infer.quant import BUILDERS, Int8Matrix, int8_matrix, quantize_rows
from astrai.infer.support import products_here
from astrai.kernels import gemv
from astrai.model import Params
from astrai.model.layers import FUSED, project
from astrai.timing import best_of_rounds, pass_seconds

log = logging.getLogger("astrai.infer")

EMBED_KEY = "model.embed_tokens.weight"
LAYERS = "model.layers."  # the keys of the layers' weights begin so
QUANTIZE = ("int8", "int4")
SWEEP_BYTES = 256 << 20  # scratch for timing the layouts of one shape
TUNE_ROWS = (1, 16)  # batch sizes the choices are timed at: one stream, and a busy server
DENSE_ROWS = (64, 256, 1024)  # int4: the prompt-sized inputs the dense road is timed at
DENSE_SAMPLE = 4096  # output rows it is timed on at most
SPLIT_ROWS = (1, 4, 16)  # int8: one stream, a few, and a busy server (see _int8_choice)
# A decode step runs its layers in one C call where every layer matrix is one of our C
# products (astrai.infer.fused_layers: the float ones in these layouts), which saves the Python
# around each layer's ops: ~120 us a layer on a 2-core AMD Zen 5 (a 0.5B float32 step at one row,
# 2.9 ms over 24 layers), ~140 on a 2-core Intel Xeon. So the layers' matrices all take one of
# these where that costs a layer at most LAYER_SECONDS over their fastest layouts, on average over
# the row counts timed (a single row count's figure for a matrix wavers by a few tens of us). On
# the AMD Zen 5 the 0.5B bfloat16 layers with the down projections packed for oneDNN (1.3-1.5x as
# fast so at 16 rows alone, 80-115 us a layer, and a little slower at one row) took a step 1.13x
# as long at one row and 1.04x at 16 as all of them in one call; in float32 1.07x and 1.01x. The
# 1B shape's bfloat16 layers, whose matrices the timings put ~140 us a layer behind on
# average in our layouts, ran a step 1.06x as fast at one row and 1.07x at 16 in one call, so the
# call saves more than its Python alone once the layers are larger.
# (The call takes matrices stored by columns as a copy, within its budget for copies: a small
# model's. A model the call does not take at all loses at most LAYER_SECONDS a layer: the
# weights alone do not say which models it takes.)
ONE_CALL = ("gemv", "panels", "rows", "columns")
LAYER_SECONDS = 200e-6


def runnable(dtype: torch.dtype, shape: tuple[int, int], device="cpu") -> list[str]:
    """The products of `dtype` matrices of `shape` that run here (astrai.infer.support). Where
    none does, a ValueError naming each one and why: the weights cannot take this form here."""
    reasons = products_here(dtype, shape, device)
    if names := [name for name, reason in reasons.items() if reason is None]:
        return names
    tried = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    kind = str(dtype).removeprefix("torch.")
    raise ValueError(
        f"no {kind} product runs on {device} for a {shape[0]}x{shape[1]} matrix ({tried})"
    )


@functools.cache
def _layout_seconds(
    out_features: int, in_features: int, dtype: torch.dtype, copies: int, threads: int
) -> dict[int, dict[str, float]]:
    """{rows: {layout of LAYOUTS that runs here: seconds a matrix}} for [out, in] matrices at
    each of TUNE_ROWS rows. Which layout wins differs from machine to machine, so it is
    measured, the way a decode step reads the matrices (streamed one after the other, not one
    read again from cache): a pass over `copies` matrices of the shape, best of three
    alternating rounds."""
    plain = [torch.full((out_features, in_features), 0.01, dtype=dtype) for _ in range(copies)]
    names = runnable(dtype, (out_features, in_features))
    candidates = {
        name: [functools.partial(project, weight=LAYOUTS[name](w)) for w in plain] for name in names
    }
    seconds = {}
    for rows in TUNE_ROWS:
        x = torch.full((rows, in_features), 0.5, dtype=dtype)
        passes = best_of_rounds(candidates, functools.partial(pass_seconds, x=x))
        seconds[rows] = {name: t / copies for name, t in passes.items()}
    log.info(
        "%s %dx%d (x%d): ms a pass, %s",
        str(dtype).removeprefix("torch."),
        out_features,
        in_features,
        copies,
        "; ".join(
            f"{rows} rows: "
            + ", ".join(f"{name} {t * copies * 1e3:.3f}" for name, t in times.items())
            for rows, times in seconds.items()
        ),
    )
    return seconds


def _least_behind(seconds: dict[int, dict[str, float]], names) -> str:
    """The one of `names` whose worst ratio to the fastest layout at any of the row counts of
    `seconds` is least."""
    return min(names, key=lambda name: max(t[name] / min(t.values()) for t in seconds.values()))


@functools.cache
def _fastest_layout(
    out_features: int, in_features: int, dtype: torch.dtype, copies: int, threads: int
) -> str:
    """The layout of LAYOUTS in which [out, in] matrices multiply nearest the fastest at every
    row count (_layout_seconds): the one whose worst ratio to the fastest at any of TUNE_ROWS is
    least, since one a few percent behind at 16 rows but a quarter ahead at one row serves both
    a busy server and a single stream."""
    seconds = _layout_seconds(out_features, in_features, dtype, copies, threads)
    choice = _least_behind(seconds, seconds[TUNE_ROWS[0]])
    kind = str(dtype).removeprefix("torch.")
    log.info("%s %dx%d: %s layout", kind, out_features, in_features, choice)
    return choice


def _one_call_layouts(per_layer: dict, timed: dict) -> dict:
    """{kind: its layout of ONE_CALL} for the layers' matrix kinds (`per_layer`: {(shape,
    dtype): matrices of it a layer}; `timed`: {kind: _layout_seconds' arguments}) where that
    costs a layer at most LAYER_SECONDS over their fastest layouts, on average over TUNE_ROWS;
    else {}."""
    seconds = {kind: _layout_seconds(*timed[kind]) for kind in per_layer}
    ours = {}
    for kind, times in seconds.items():
        if not (names := [name for name in ONE_CALL if name in times[TUNE_ROWS[0]]]):
            return {}
        ours[kind] = _least_behind(times, names)
    lost = sum(
        n * (seconds[kind][rows][ours[kind]] - min(seconds[kind][rows].values()))
        for kind, n in per_layer.items()
        for rows in TUNE_ROWS
    )
    return ours if lost <= LAYER_SECONDS * len(TUNE_ROWS) else {}


@functools.cache
def _int8_seconds(
    out_features: int, in_features: int, device: str, copies: int, threads: int
) -> dict[int, dict[str, float]]:
    """{rows: {product of quant.BUILDERS that runs here: seconds a matrix}} for [out, in] at
    each of SPLIT_ROWS rows. Timed as a decode step reads them, streamed: a pass over `copies`
    matrices of the shape, best of three alternating rounds."""
    kernels = runnable(torch.int8, (out_features, in_features), device)
    q, scale = quantize_rows(torch.randn(out_features, in_features, device=device))
    # a copy of q each: a product that reads q where it lies would otherwise read it from cache
    runs = {k: [BUILDERS[k](q.clone(), scale) for _ in range(copies)] for k in kernels}
    seconds, shape = {}, f"{out_features}x{in_features} (x{copies})"
    for rows in SPLIT_ROWS:
        x = torch.randn(rows, in_features, device=device)
        passes = best_of_rounds(runs, functools.partial(pass_seconds, x=x))
        seconds[rows] = {name: t / copies for name, t in passes.items()}
        shown = ", ".join(f"{k} {t * 1e3:.3f} ms" for k, t in passes.items())
        log.info("int8 %s at %d rows: %s a pass", shape, rows, shown)
    return seconds


def _int8_choice(
    seconds: dict[int, dict[str, float]], few: str | None = None
) -> tuple[str, tuple[int, str] | None]:
    """(kernel, split): `few`, or the product of `seconds` (_int8_seconds) fastest at one row,
    and where another is faster at 16 rows the split (rows, other) that hands it inputs of
    more rows (rows 4 when `few` is also the fastest at 4, else 1)."""
    winners = {rows: min(times, key=times.get) for rows, times in seconds.items()}
    few, many = few or winners[SPLIT_ROWS[0]], winners[SPLIT_ROWS[-1]]
    if few == many:
        return few, None
    return few, (SPLIT_ROWS[1] if winners[SPLIT_ROWS[1]] == few else SPLIT_ROWS[0], many)


def int8_products(matrices: Params, copies: Counter) -> dict[torch.Size, tuple]:
    """{shape: (kernel, split)} for these {key: float matrix} in 8 bits: each shape's fastest
    product (_int8_choice, `copies` of it streamed), and the layers' our C product ("gemv")
    at one row where that costs a layer at most LAYER_SECONDS there, so that a one-row step
    keeps its layers in one C call. (Held to AVX2 on a 2-core AMD Zen 4, fbgemm's product and
    ours ran the 0.5B shapes at one row within ~15 us a matrix of each other, either one ahead
    from one process to the next; a one-row step with every layer matrix in fbgemm's ran 29-36
    tok/s, with ours in one call 47-55.)"""
    threads = torch.get_num_threads()
    devices = {w.shape: str(w.device) for w in matrices.values()}
    seconds = {
        shape: _int8_seconds(*shape, device, copies[shape], threads)
        for shape, device in devices.items()
    }
    choices = {shape: _int8_choice(times) for shape, times in seconds.items()}
    per_layer = _per_layer({key: w.shape for key, w in matrices.items()})
    one_row = {shape: seconds[shape][SPLIT_ROWS[0]] for shape in per_layer}
    lost = sum(
        n * (one_row[shape].get("gemv", math.inf) - min(one_row[shape].values()))
        for shape, n in per_layer.items()
    )
    if lost <= LAYER_SECONDS:
        choices |= {shape: _int8_choice(seconds[shape], "gemv") for shape in per_layer}
    return choices


@functools.cache
def _fastest_int4(
    out_features: int, in_features: int, device: str, copies: int, threads: int
) -> tuple[str, int]:
    """(kernel, group): the 4-bit product of int4.BUILDERS among those that run here, and the
    group size of int4.GROUPS that divides in_features, fastest together for [out, in]. Timed
    as a decode step reads them, streamed: a pass over `copies` matrices of the shape at each
    of TUNE_ROWS rows, best of three alternating rounds. One matrix timed again and again stays
    in cache, where the group sizes cost the same, while a step streams from memory, where the
    larger groups' fewer bytes count (5.0 bits a weight at group 32, 4.25 at 128)."""
    kernels = runnable(torch.int4, (out_features, in_features), device)
    w = torch.randn(out_features, in_features, device=device)
    inputs = [torch.randn(rows, in_features, device=device) for rows in TUNE_ROWS]
    candidates = {}
    for group in int4.groups_for(in_features):
        q, scale, zero = int4.quantize_groups(w, group)
        for kernel in kernels:
            build = int4.BUILDERS[kernel]
            candidates[kernel, group] = [build(q, scale, zero, group)[1] for _ in range(copies)]

    timings = best_of_rounds(candidates, lambda runs: sum(pass_seconds(runs, x) for x in inputs))
    best = min(timings, key=timings.get)
    shown = ", ".join(f"{k}/{g} {t * 1e3:.3f} ms" for (k, g), t in timings.items())
    log.info("int4 %dx%d (x%d): %s/%d (%s a pass)", out_features, in_features, copies, *best, shown)
    return best


def fastest_int4(
    out_features: int, in_features: int, device: torch.device, copies: int = 1
) -> tuple[str, int, int | None, str]:
    """(kernel, group size, split, road): the 4-bit product fastest for `copies` [out, in]
    matrices streamed one after the other here, and for gemv the road of prompt-sized inputs
    and the rows past which it pays (_int4_split; both cached)."""
    threads = torch.get_num_threads()
    kernel, group = _fastest_int4(out_features, in_features, str(device), copies, threads)
    if kernel != "gemv":
        return kernel, group, None, "dense"
    return kernel, group, *_int4_split(out_features, in_features, str(device), group, threads)


@functools.cache
def _int4_split(
    out_features: int, in_features: int, device: str, group: int, threads: int
) -> tuple[int | None, str]:
    """(split, road): the road (int4.ROADS, those that run here) fastest at the most rows of
    DENSE_ROWS for float32 inputs, and the rows up to which gemv stays faster than it: the
    count before the first at which the road wins, None where it never does. Timed on at most
    DENSE_SAMPLE output rows: each takes the same time per output at these row counts, and
    the head has 150,000 of them."""
    w = torch.randn(min(out_features, DENSE_SAMPLE), in_features, device=device)
    roads = ["dense", "gemm"] if gemv.isa() == 2 else ["dense"]
    runs = {"gemv": [int4.int4_matrix(w, "gemv", group).run]}
    for road in roads:  # split 0: every input takes the road
        runs[road] = [int4.int4_matrix(w, "gemv", group, split=0, road=road).run]
    timings = {}
    for rows in DENSE_ROWS:
        x = torch.randn(rows, in_features, device=device)
        timings[rows] = best_of_rounds(runs, functools.partial(pass_seconds, x=x))
        log.info(
            "int4 %dx%d/%d at %d rows: %s", out_features, in_features, group, rows,
            ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in timings[rows].items()),
        )  # fmt: skip
    road = min(roads, key=timings[DENSE_ROWS[-1]].get)
    before = TUNE_ROWS[-1]
    for rows in DENSE_ROWS:
        if timings[rows][road] < timings[rows]["gemv"]:
            return before, road
        before = rows
    return None, road


def _copies(matrices: list[torch.Tensor], bits: int) -> Counter:
    """{shape: how many of the matrices to stream when timing it}: as many as the model has,
    within SWEEP_BYTES of scratch at `bits` a weight."""
    kinds = Counter(w.shape for w in matrices)
    return Counter(
        {
            shape: min(n, max(1, 8 * SWEEP_BYTES // (bits * shape.numel())))
            for shape, n in kinds.items()
        }
    )


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


def _layouts(matrices: Params) -> dict[tuple[torch.Size, torch.dtype], str]:
    """{(shape, dtype): fastest layout} for the float CPU matrices among these {key: matrix},
    the layers' all in ONE_CALL where that costs a layer at most LAYER_SECONDS on average
    (_one_call_layouts)."""
    floats = {key: w for key, w in matrices.items() if _is_float_cpu(w)}
    kinds = Counter((w.shape, w.dtype) for w in floats.values())
    threads = torch.get_num_threads()
    # enough matrices to stream as the model does, within SWEEP_BYTES of scratch each
    timed = {
        (shape, dtype): (
            *shape,
            dtype,
            min(n, max(1, SWEEP_BYTES // (dtype.itemsize * shape.numel()))),
            threads,
        )
        for (shape, dtype), n in kinds.items()
    }
    fastest = {kind: _fastest_layout(*args) for kind, args in timed.items()}
    per_layer = _per_layer({key: (w.shape, w.dtype) for key, w in floats.items()})
    if all(fastest[kind] in ONE_CALL for kind in per_layer):
        return fastest
    return fastest | _one_call_layouts(per_layer, timed)


def _per_layer(kinds: dict) -> dict:
    """{kind: how many matrices of it a layer has}, from {key: its matrix's kind}: the layers'
    keys counted over the number of layers (the head and other matrices outside them left out)."""
    in_layers = [key for key in kinds if key.startswith(LAYERS)]
    layers = len({key.removeprefix(LAYERS).split(".")[0] for key in in_layers})
    return {kind: n / layers for kind, n in Counter(kinds[key] for key in in_layers).items()}


def _is_float_cpu(w) -> bool:
    return isinstance(w, torch.Tensor) and w.dtype in DTYPES and w.device.type == "cpu"


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

    Sibling projections that read the same input are fused (see astrai.model.layers.FUSED): q,
    k and v into `qkv_proj`, gate and up into `gate_up_proj`. Each float32 or bfloat16 CPU
    matrix takes the layout of LAYOUTS that multiplies fastest on this machine (measured once
    per shape and cached, among those that run here: astrai.infer.support): kept [out, in],
    stored [in, out]-contiguous, packed for oneDNN (a PackedMatrix), kept [out, in] for our
    kernel at a decode step's rows (a GemvMatrix) or in panels for our panel kernel (a
    PanelMatrix). With `quantize="int8"` the matrices of the layers and the head become
    Int8Matrix values (8-bit weights, one scale per output channel, the fastest int8 product
    that runs here; where none runs for a shape, the error names each product and why). With
    `quantize="int4"` they become Int4Matrix values the same way (4-bit weights, a scale and a
    zero point per group of inputs, the product and group size measured fastest here). The
    embedding and the norms keep their dtype and layout. With tied embeddings a head laid out
    otherwise is a copy of its own, so the embedding lookup keeps reading whole rows.

    Inference also wants the process's C allocator to keep freed temporaries for reuse, so
    this turns that on once per process, after the weights are placed
    (astrai.infer.allocator.keep_freed_memory).
    """
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE} or None, got {quantize!r}")
    params = fuse_projections(params)
    if "lm_head.weight" not in params and EMBED_KEY in params:
        params["lm_head.weight"] = params[EMBED_KEY]  # laid out (a copy) as a matrix below
    matrices = {key: w for key, w in params.items() if _is_matrix(key, w)}
    if quantize == "int8":
        products = int8_products(matrices, _copies(list(matrices.values()), bits=8))
        params |= {key: int8_matrix(w, *products[w.shape]) for key, w in matrices.items()}
    elif quantize == "int4":
        copies = _copies(list(matrices.values()), bits=4)
        params |= {
            key: int4.int4_matrix(w, *fastest_int4(*w.shape, w.device, copies[w.shape]))
            for key, w in matrices.items()
        }
    else:
        layouts = _layouts(matrices)
        for key, w in matrices.items():
            if _is_float_cpu(w):
                params[key] = LAYOUTS[layouts[w.shape, w.dtype]](w)
    keep_freed_memory()  # after the weights are placed: only the temporaries
    return params


def kernels_used(params: Params) -> dict[str, int]:
    """How many matrices of prepared params run each product: an Int8Matrix's product (its
    kernel, or "A up to N rows, then B"), a PackedMatrix's kernel, "int4 KERNEL/GROUP" for an
    Int4Matrix (and "up to N rows, then ROAD" where it splits), "float" for a plain tensor."""
    counts: Counter[str] = Counter()
    for key, w in params.items():
        if isinstance(w, (int4.Int4Matrix, Int8Matrix)):
            counts[w.product] += 1
        elif not isinstance(w, torch.Tensor):
            counts[w.kernel] += 1
        elif _is_matrix(key, w):
            counts["float"] += 1
    return dict(counts)
