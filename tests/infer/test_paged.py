"""prefill / decode_step over the page pool give the logits of a full forward pass."""

from __future__ import annotations

import pytest
import torch
from infer_models import CONFIGS, make_model
from numerics import assert_close, forward_roundings, tolerance

import astrai as ai
from astrai.infer import (
    alloc_pages,
    decode_step,
    init_pages,
    kernels_used,
    prefill,
    prepare,
    prepare_params,
)
from astrai.infer.layouts import LAYOUTS
from astrai.infer.support import products_here
from astrai.kernels import prompt_attention
from astrai.model import masked_attention

PAGE_SIZE = 4


@pytest.fixture(params=["fused", "products", "kernel"], autouse=True)
def attention(request, monkeypatch):
    """Every test here runs with prompt chunks attended by each path, whichever one this
    machine measures faster (astrai/model/masked_attention.py), without gradients as the
    Engine runs them: torch's fused kernel, its products, our prompt kernel (where it runs)."""
    if request.param == "kernel" and not prompt_attention.runs_here():
        pytest.skip("the prompt attention kernel takes AVX-512")
    monkeypatch.setattr(
        masked_attention, "products_win", lambda *shape: request.param == "products"
    )
    monkeypatch.setattr(masked_attention, "kernel_wins", lambda *shape: request.param == "kernel")
    with torch.no_grad():
        yield request.param


def shuffled_table(pool, rows: int, width: int, seed: int = 0):
    """A page table whose pages are scattered over the pool, as after much alloc and free."""
    pool, pages = alloc_pages(pool, rows * width)
    order = torch.randperm(len(pages), generator=torch.Generator().manual_seed(seed))
    return pool, torch.tensor(pages)[order].view(rows, width)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_prefill_then_decode_matches_forward(kind):
    params, cfg = make_model(kind)
    tokens = torch.randint(0, cfg.vocab_size, (1, 14), generator=torch.Generator().manual_seed(1))
    full = ai.forward(params, cfg, tokens)
    pool = init_pages(cfg, 16, PAGE_SIZE)
    pool, table = shuffled_table(pool, 1, 4)
    logits, pool = prefill(params, cfg, pool, tokens[:, :9], table, 0)
    assert_close(logits, full[:, 8], forward_roundings(cfg, 14))
    for t in range(9, 14):
        logits, pool = decode_step(params, cfg, pool, tokens[:, t], torch.tensor([t]), table)
        assert_close(logits, full[:, t], forward_roundings(cfg, 14))


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_prefill_then_decode_matches_forward_in_bf16(kind):
    # Attention by products holds the scores and the probabilities in bf16 (a rounding each),
    # the fused kernels hold them in float32: a few bf16 roundings a layer apart, like the
    # weight layouts below.
    params, cfg = make_model(kind)
    params = {k: v.to(torch.bfloat16) for k, v in params.items()}
    tokens = torch.randint(0, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1))
    full = ai.forward(params, cfg, tokens)
    pool = init_pages(cfg, 16, PAGE_SIZE, torch.bfloat16)
    pool, table = shuffled_table(pool, 2, 4)
    logits, pool = prefill(params, cfg, pool, tokens[:, :9], table, 0)
    # prefill and decode_step hand back float32 logits of bf16 computations
    close = tolerance(8 * cfg.num_hidden_layers, torch.bfloat16, full.abs().max().item())
    torch.testing.assert_close(logits, full[:, 8].float(), **close)
    for t in range(9, 14):
        logits, pool = decode_step(params, cfg, pool, tokens[:, t], torch.tensor([t, t]), table)
        torch.testing.assert_close(logits, full[:, t].float(), **close)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_chunked_prefill_equals_one_shot(kind):
    params, cfg = make_model(kind)
    tokens = torch.randint(0, cfg.vocab_size, (1, 13), generator=torch.Generator().manual_seed(2))
    pool = init_pages(cfg, 16, PAGE_SIZE)
    pool, table = shuffled_table(pool, 1, 4)
    one_shot, pool = prefill(params, cfg, pool, tokens, table, 0)
    for start, end in [(0, 5), (5, 6), (6, 13)]:
        chunked, pool = prefill(params, cfg, pool, tokens[:, start:end], table, start)
    assert_close(chunked, one_shot, forward_roundings(cfg, 13))


@pytest.mark.parametrize("kind", ["gqa", "moe"])
def test_padded_batch_equals_each_row_alone(kind):
    params, cfg = make_model(kind)
    g = torch.Generator().manual_seed(3)
    lengths = [7, 3, 10]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    batch = torch.zeros(3, 10, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
    pool = init_pages(cfg, 32, PAGE_SIZE)
    pool, table = shuffled_table(pool, 3, 4)
    logits, pool = prefill(params, cfg, pool, batch, table, 0, lengths=torch.tensor(lengths))
    next_tokens = logits.argmax(-1)
    step, pool = decode_step(params, cfg, pool, next_tokens, torch.tensor(lengths), table)
    for i, p in enumerate(prompts):
        seq = torch.cat([p, next_tokens[i : i + 1]])[None]
        full = ai.forward(params, cfg, seq)
        assert_close(logits[i], full[0, -2], forward_roundings(cfg, 11))
        assert_close(step[i], full[0, -1], forward_roundings(cfg, 11))


def test_prefill_after_cached_prefix_and_per_row_start():
    params, cfg = make_model("gqa")
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    pool = init_pages(cfg, 32, PAGE_SIZE)
    pool, table = shuffled_table(pool, 2, 3)
    # row 0 has 8 tokens of K/V already, row 1 has 4; feed the rest as one padded chunk
    _, pool = prefill(params, cfg, pool, a[None, :8], table[:1], 0)
    _, pool = prefill(params, cfg, pool, b[None, :4], table[1:], 0)
    chunk = torch.stack([torch.cat([a[8:], torch.zeros(4, dtype=torch.long)]), b[4:]])
    logits, pool = prefill(
        params, cfg, pool, chunk, table, torch.tensor([8, 4]), lengths=torch.tensor([4, 8])
    )
    assert_close(logits[0], ai.forward(params, cfg, a[None])[0, -1], forward_roundings(cfg, 12))
    assert_close(logits[1], ai.forward(params, cfg, b[None])[0, -1], forward_roundings(cfg, 12))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gqa", "gqa_variants", "mla", "moe"])
def test_prepared_params_give_the_same_logits(kind, dtype, layout, monkeypatch):
    # each layout that runs here, whichever one this machine measures fastest
    if reason := products_here(dtype)[layout]:
        pytest.skip(f"the {layout} layout of {dtype} matrices: {reason}")
    monkeypatch.setattr(prepare, "_fastest_layout", lambda *shape_and_kind: layout)
    monkeypatch.setattr(prepare, "_one_call_layouts", lambda *layers: {})
    params, cfg = make_model(kind)
    params = {k: v.to(dtype) for k, v in params.items()}
    prepared = prepare_params(params)
    layers = range(cfg.num_hidden_layers)
    # every MLP's gate and up (a mixture of experts: its shared experts'); GQA's q, k and v
    # (MLA's projections read different inputs)
    mlps = [f"model.layers.{i}.mlp" + (".shared_experts" * cfg.is_moe_layer(i)) for i in layers]
    fused = {f"{mlp}.gate_up_proj.weight" for mlp in mlps}
    if cfg.attn_type == "gqa":
        kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
        fused |= {f"model.layers.{i}.self_attn.qkv_proj.{k}" for i in layers for k in kinds}
    assert prepared.keys() - params.keys() == {"lm_head.weight"} | fused
    assert set(kernels_used(prepared)) == {
        {"packed": "onednn", "gemv": "gemv", "panels": "panels"}.get(layout, "float")
    }
    tokens = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5))
    # The same numbers in other layouts and fused products: another summation order. In bf16
    # products accumulate in float32 and round their output once, so another order can move a
    # few bf16 roundings per layer by one step each.
    roundings = forward_roundings(cfg, 6) if dtype == torch.float32 else 8 * cfg.num_hidden_layers
    assert_close(ai.forward(prepared, cfg, tokens), ai.forward(params, cfg, tokens), roundings)


def test_fused_weights_take_lora_adapters():
    params, cfg = make_model("gqa")
    lora = ai.init_lora(params, cfg, rank=2)
    for pair in lora["weights"].values():
        pair["B"] = torch.randn_like(pair["B"])
    tokens = torch.tensor([[1, 2, 3]])
    fused = ai.forward(prepare_params(params), cfg, tokens, lora=lora)
    # the same numbers in another layout and fused products: another summation order
    assert_close(fused, ai.forward(params, cfg, tokens, lora=lora), forward_roundings(cfg, 3))


def test_position_past_the_page_table_is_an_error():
    params, cfg = make_model("gqa")
    pool = init_pages(cfg, 8, PAGE_SIZE)
    pool, table = shuffled_table(pool, 1, 2)
    with pytest.raises(ValueError, match="page table"):
        decode_step(params, cfg, pool, torch.tensor([1]), torch.tensor([8]), table)
