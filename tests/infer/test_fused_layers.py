"""A decode step's layers in one C call (astrai/infer/fused_layers.py) give bit for bit the
logits of the same layers run one kernel at a time from Python, for every product it calls; a
chunk of tokens in one call gives the logits of the same tokens decoded one at a time; and the
call steps aside wherever it does not run a model, its weights or a step."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from infer_models import BASE, every_int8
from numerics import assert_close, forward_roundings, tolerance

import astrai as ai
from astrai.infer import (
    alloc_pages,
    decode_step,
    init_pages,
    paged,
    prefill,
    prefill_logits,
    prepare,
    prepare_params,
)
from astrai.infer import fused_layers as fused
from astrai.infer.support import products_here
from astrai.kernels.build import why_absent

pytestmark = pytest.mark.skipif(why_absent() is not None, reason=f"no C kernels: {why_absent()}")

MODELS = {
    "plain": ai.ModelConfig(**BASE),
    # Qwen2's q/k/v biases, a layer without RoPE, GeGLU, an explicit attention scale
    "variants": ai.ModelConfig(
        **{**BASE, "num_hidden_layers": 3},
        attention_bias=True,
        nope_layers=(1,),
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=12,
    ),
}
PRODUCTS = {  # how prepare_params is told to lay out every matrix, by quantize
    None: ("_fastest_layout", lambda *shape: "gemv"),
    "int8": ("int8_products", every_int8("gemv")),
    "int4": ("fastest_int4", lambda *shape: ("gemv", 32)),
}


def model(kind: str, dtype: torch.dtype, quantize, monkeypatch, layout: str = "gemv"):
    """Prepared params of the model `kind`, every matrix multiplied by our C product (float
    matrices in `layout`, "gemv" or "panels")."""
    if quantize is None and (reason := products_here(dtype)[layout]):
        pytest.skip(f"the {layout} layout of {dtype}: {reason}")
    monkeypatch.setattr(prepare, *PRODUCTS[quantize])
    if quantize is None:
        monkeypatch.setattr(prepare, "_fastest_layout", lambda *shape: layout)
    cfg = MODELS[kind]
    params = ai.init_params(cfg, seed=3)
    g = torch.Generator().manual_seed(3)
    for key in [k for k in params if k.endswith(".bias")]:  # non-zero: a lost bias shows
        params[key] = torch.randn(params[key].shape, generator=g) * 0.3
    return prepare_params({k: v.to(dtype) for k, v in params.items()}, quantize), cfg


def decode(params, cfg, dtype, rows: int, steps: int = 6, pool_dtype=None) -> torch.Tensor:
    """The logits of `steps` greedy decode steps of `rows` rows after 9-token prompts, which
    the layers run from Python on every side (their K/V alike for the steps compared)."""
    pool = init_pages(cfg, 8 * rows, 4, pool_dtype or dtype)
    pool, pages = alloc_pages(pool, 8 * rows)
    table = torch.tensor(pages).view(rows, 8).flip(1)  # pages out of order
    prompt = torch.randint(0, cfg.vocab_size, (rows, 9), generator=torch.Generator().manual_seed(0))
    logits, pool = prefill_in_python(params, cfg, pool, prompt, table)
    out = []
    with torch.no_grad():
        for position in range(9, 9 + steps):
            token, at = logits.argmax(-1), torch.full((rows,), position)
            logits, pool = decode_step(params, cfg, pool, token, at, table)
            out.append(logits)
    return torch.stack(out)


def prefill_in_python(params, cfg, pool, prompt, table):
    """prefill's (logits, pool), the layers run from Python whatever the test chose."""
    chosen, paged.fused_layers = paged.fused_layers, lambda *args: None
    try:
        with torch.no_grad():
            return prefill(params, cfg, pool, prompt, table, 0)
    finally:
        paged.fused_layers = chosen


def counted(monkeypatch) -> list[bool]:
    """Whether each step's layers ran in C, from now on."""
    ran = []

    def counting(*args):
        hidden = fused.fused_layers(*args)
        ran.append(hidden is not None)
        return hidden

    monkeypatch.setattr(paged, "fused_layers", counting)
    return ran


def in_python(monkeypatch) -> None:
    monkeypatch.setattr(paged, "fused_layers", lambda *args: None)


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "quantize, layout", [(None, "gemv"), (None, "panels"), ("int8", None), ("int4", None)]
)
@pytest.mark.parametrize("rows", [1, 3])
def test_the_layers_in_c_give_the_python_layers_logits(
    kind, dtype, quantize, layout, rows, monkeypatch
):
    params, cfg = model(kind, dtype, quantize, monkeypatch, layout)
    ran = counted(monkeypatch)
    in_c = decode(params, cfg, dtype, rows)
    assert ran and all(ran)
    in_python(monkeypatch)
    assert torch.equal(in_c, decode(params, cfg, dtype, rows))


def test_a_pool_of_another_dtype(monkeypatch):
    params, cfg = model("plain", torch.float32, None, monkeypatch)
    ran = counted(monkeypatch)
    in_c = decode(params, cfg, torch.float32, 2, pool_dtype=torch.bfloat16)
    assert all(ran)
    in_python(monkeypatch)
    assert torch.equal(in_c, decode(params, cfg, torch.float32, 2, pool_dtype=torch.bfloat16))


def test_more_rows_than_a_product_runs_in_c_go_to_python(monkeypatch):
    monkeypatch.setattr(prepare, "int8_products", every_int8("gemv", (2, "weight_only")))
    cfg = MODELS["plain"]
    params = prepare_params(ai.init_params(cfg, seed=3), "int8")
    ran = counted(monkeypatch)
    decode(params, cfg, torch.float32, rows=2, steps=2)
    decode(params, cfg, torch.float32, rows=3, steps=2)
    assert ran == [True, True, False, False]


@pytest.mark.parametrize(
    "change",
    [{"use_qk_norm": True}, {"sliding_window": 4, "layer_types": ["sliding_attention"] * 2}],
)
def test_layers_it_does_not_run_go_to_python(change, monkeypatch):
    cfg = ai.ModelConfig(**BASE, **change)
    assert not fused.takes_model(cfg)
    monkeypatch.setattr(prepare, *PRODUCTS[None])
    params = prepare_params(ai.init_params(cfg, seed=3))
    ran = counted(monkeypatch)
    decode(params, cfg, torch.float32, rows=1, steps=2)
    assert ran == [False, False]


def test_a_weight_put_in_place_of_another_is_the_one_multiplied(monkeypatch):
    params, cfg = model("plain", torch.float32, "int8", monkeypatch)
    decode(params, cfg, torch.float32, 1)  # the plan is built for these weights
    key = "model.layers.1.mlp.down_proj.weight"
    weight = torch.randn(params[key].shape) * 0.3
    params[key] = prepare_params({key: weight}, "int8")[key]
    ran = counted(monkeypatch)
    in_c = decode(params, cfg, torch.float32, 1)
    assert all(ran)
    in_python(monkeypatch)
    assert torch.equal(in_c, decode(params, cfg, torch.float32, 1))


def test_a_plan_keeps_no_weights_alive(monkeypatch):
    params, cfg = model("plain", torch.float32, "int4", monkeypatch)
    decode(params, cfg, torch.float32, 1, steps=1)
    gone = weakref.ref(params["model.layers.0.self_attn.qkv_proj.weight"])
    del params
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantize", [None, "int4"])
def test_a_chunk_of_tokens_is_the_same_tokens_decoded_one_at_a_time(dtype, quantize, monkeypatch):
    # speculated tokens verified in one call, rows of different lengths (padded): each real
    # token a row of the C call, attending over its sequence's pages up to its own position
    params, cfg = model("variants", dtype, quantize, monkeypatch)
    # the chunk's 11 rows in the call, where timing would send them to Python (bfloat16 dot
    # products held to AVX2 can trail torch's products from a few rows on)
    monkeypatch.setattr(fused, "kernel_rows", lambda dtype: 16)
    ran = counted(monkeypatch)
    lengths = [5, 2, 4]
    chunks = torch.randint(0, cfg.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))

    def fresh():
        pool, pages = alloc_pages(init_pages(cfg, 24, 4, dtype), 24)
        table = torch.tensor(pages).view(3, 8).flip(1)
        prompt = torch.randint(
            0, cfg.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0)
        )
        return prefill_in_python(params, cfg, pool, prompt, table)[1], table

    with torch.no_grad():
        pool, table = fresh()
        together, _ = prefill_logits(
            params, cfg, pool, chunks, table, 7, lengths=torch.tensor(lengths)
        )
        pool, table = fresh()
        apart = [[] for _ in lengths]  # each row's tokens one decode step at a time
        for row, n in enumerate(lengths):
            for t in range(n):
                token, at = chunks[row, t : t + 1], torch.tensor([7 + t])
                logits, pool = decode_step(params, cfg, pool, token, at, table[row : row + 1])
                apart[row].append(logits[0])
    assert all(ran)
    for row, n in enumerate(lengths):
        for t in range(5):  # a padded position's logits are its row's last real token's
            expected = apart[row][min(t, n - 1)]
            assert_close(together[row, t], expected, forward_roundings(cfg, 12))


@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_float_matrices_run_our_float_product(dtype, layout, monkeypatch):
    # matrices kept as torch holds them, or stored [in, out] (the layouts a small draft's take
    # where torch's product times faster alone), run our float product in the call: not
    # torch's bits, its roundings
    monkeypatch.setattr(prepare, "_fastest_layout", lambda *shape: layout)
    monkeypatch.setattr(prepare, "_one_call_layouts", lambda *layers: {})
    cfg = MODELS["variants"]
    params = prepare_params({k: v.to(dtype) for k, v in ai.init_params(cfg, seed=3).items()})
    down = params["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, torch.Tensor) and down.is_contiguous() == (layout == "rows")
    ran = counted(monkeypatch)
    in_c = decode(params, cfg, dtype, 2, steps=1)
    assert all(ran)
    in_python(monkeypatch)
    expected = decode(params, cfg, dtype, 2, steps=1)
    scale = expected.abs().max().item()
    tol = tolerance(forward_roundings(cfg, 10), dtype, scale)
    torch.testing.assert_close(in_c, expected, **tol)


def test_matrices_stored_by_columns_are_copied_within_a_budget(monkeypatch):
    # past the budget for copies [out, in] the layers run in Python
    monkeypatch.setattr(prepare, "_fastest_layout", lambda *shape: "columns")
    monkeypatch.setattr(prepare, "_one_call_layouts", lambda *layers: {})
    cfg, dtype = MODELS["plain"], torch.float32
    params = prepare_params(ai.init_params(cfg, seed=3))
    layer = sum(params[f"model.layers.0.{m}.weight"].nbytes for m in fused.MATRICES.values())
    ran = counted(monkeypatch)
    for budget, in_c in ((cfg.num_hidden_layers * layer, True), (layer, False)):
        monkeypatch.setattr(fused, "COPY_BYTES", budget)
        fused._kept.clear()
        ran.clear()
        decode(params, cfg, dtype, 1)
        assert ran and all(r == in_c for r in ran)


@pytest.mark.parametrize("lost", [0.5, 2.0])
def test_a_layers_matrices_keep_to_the_one_call_where_it_pays(lost, monkeypatch, fresh_choices):
    # the down projections and the head multiply nearest the fastest packed for oneDNN, every
    # other matrix in our kernel's layout; the down projections in ours lose `lost` times what
    # one call saves a layer at 16 rows and as much at one: below it the layers all take ours and run in
    # one call, past it the down projections are packed and the layers run in Python; the
    # head, outside the call, takes its own fastest either way
    if reason := products_here(torch.float32)["packed"]:
        pytest.skip(f"no packed float32 layout: {reason}")
    cfg = MODELS["plain"]
    down, head = (cfg.hidden_size, cfg.intermediate_size), (cfg.vocab_size, cfg.hidden_size)
    saved = prepare.LAYER_SECONDS

    def seconds(out_features, in_features, *_):
        if (out_features, in_features) == down:
            return {
                1: {"packed": saved, "gemv": saved * (1 + lost)},
                16: {"packed": saved, "gemv": saved * (1 + lost)},
            }
        if (out_features, in_features) == head:
            return {rows: {"packed": saved, "gemv": 2 * saved} for rows in (1, 16)}
        return {rows: {"packed": 2 * saved, "gemv": saved} for rows in (1, 16)}

    monkeypatch.setattr(prepare, "_layout_seconds", seconds)
    params = prepare_params(ai.init_params(cfg, seed=3))
    pays = lost <= 1
    down_kernel = params["model.layers.0.mlp.down_proj.weight"].kernel
    assert down_kernel == ("gemv" if pays else "onednn")
    assert params["model.layers.0.mlp.gate_up_proj.weight"].kernel == "gemv"
    assert params["lm_head.weight"].kernel == "onednn"
    ran = counted(monkeypatch)
    decode(params, cfg, torch.float32, 1, steps=2)
    assert ran and all(r == pays for r in ran)
