"""A batch whose rows use different LoRA adapters (or none) gives, row by row, what the merged
model of that row's adapter gives: through `forward`, paged prefill and decode, prepared
(fused) weights and 8-bit ones. And the adapter stack's slots hold what was loaded into them,
whatever the order of loads and unloads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from infer_models import CONFIGS, make_model
from numerics import assert_close, forward_roundings, tolerance

import astrai as ai
from astrai.infer import alloc_pages, decode_step, init_pages, prefill, prepare_params
from astrai.infer.support import products_here
from astrai.model.adapter_stack import (
    adapter_slots,
    free_slots,
    init_adapter_stack,
    stack_adapter,
    unstack_adapter,
)
from astrai.model.layers import lora_delta
from astrai.model.lora_folder import AdapterError
from astrai.model.lora_product import grouped_lora, mixed_lora

RANK = 4
EPS = torch.finfo(torch.float32).eps
ROWS = ["a", None, "b", "c", "a", None]


def adapter(params, cfg, rank, targets, alpha, seed, size=0.1):
    """A LoRA tree with random B (of standard deviation `size`), as if trained."""
    lora = ai.init_lora(params, cfg, rank, alpha, targets, seed)
    g = torch.Generator().manual_seed(seed)
    for pair in lora["weights"].values():
        pair["B"] = (torch.randn(pair["B"].shape, generator=g) * size).to(pair["B"].dtype)
    return lora


def three_adapters(params, cfg, size=0.1):
    """Different ranks, targets and scales: all projections; q and v at a lower rank; the
    MLPs' down projection (MLA's attention has no q/v: its a adapts everything)."""
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    every += ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    qv = ("q_proj", "v_proj") if cfg.attn_type == "gqa" else ("kv_b_proj", "o_proj")
    return {
        "a": adapter(params, cfg, RANK, every, 8.0, 1, size),
        "b": adapter(params, cfg, 2, qv, 4.0, 2, size),
        "c": adapter(params, cfg, RANK, ("down_proj",), 16.0, 3, size),
    }


def stacked(cfg, adapters, dtype=torch.float32, slots=4, fused=False):
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    every += ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    stack = init_adapter_stack(cfg, slots, RANK, every, dtype, fused=fused)
    for name, lora in adapters.items():
        stack = stack_adapter(stack, name, lora)
    return stack


def merged_rows(params, cfg, adapters, tokens):
    """Each row through the merged model of its adapter (the base model for None)."""
    rows = []
    for i, name in enumerate(ROWS):
        weights = params if name is None else ai.merge_lora(params, adapters[name])
        rows.append(ai.forward(weights, cfg, tokens[i : i + 1])[0])
    return torch.stack(rows)


def bf16_roundings(cfg) -> float:
    """bf16 products accumulate in float32 and round their output once; merged weights round
    W + s * B @ A once more, the unmerged update rounds x @ A, its product with B and the sum:
    another order moves a few bf16 roundings per layer by one step each (as for prepared
    weights in test_paged.py). In float32 roundings, for assert_close on float32 values."""
    return 8 * cfg.num_hidden_layers * torch.finfo(torch.bfloat16).eps / EPS


def assert_adapters_show(expected, base, roundings):
    """Each adapted row moves the logits by more than the tolerance: a row given another
    row's adapter, or none, would fail."""
    scale = expected.abs().max().item()
    for i, name in enumerate(ROWS):
        if name is not None:
            assert (expected[i] - base[i]).abs().max() > 2 * roundings * EPS * scale


def tokens_for(cfg, length, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (len(ROWS), length), generator=g)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_each_row_gives_its_merged_model(kind):
    params, cfg = make_model(kind)
    adapters = three_adapters(params, cfg)
    stack = stacked(cfg, adapters)
    tokens = tokens_for(cfg, 7)
    with torch.no_grad():
        mixed = ai.forward(params, cfg, tokens, lora=mixed_lora(stack, adapter_slots(stack, ROWS)))
        expected = merged_rows(params, cfg, adapters, tokens)
    # merging sums W + s * B @ A (rank terms) before the products instead of after them
    assert_close(mixed, expected, forward_roundings(cfg, 7) + RANK)


def test_each_row_gives_its_merged_model_in_bf16():
    params, cfg = make_model("gqa")
    adapters = three_adapters(params, cfg, size=0.5)  # updates that dwarf bf16's roundings
    params = {k: v.to(torch.bfloat16) for k, v in params.items()}
    for lora in adapters.values():
        lora["weights"] = {
            k: {p: t.to(torch.bfloat16) for p, t in pair.items()}
            for k, pair in lora["weights"].items()
        }
    stack = stacked(cfg, adapters, torch.bfloat16)
    tokens = tokens_for(cfg, 7)
    with torch.no_grad():
        mixed = ai.forward(params, cfg, tokens, lora=mixed_lora(stack, adapter_slots(stack, ROWS)))
        expected = merged_rows(params, cfg, adapters, tokens).float()
        base = ai.forward(params, cfg, tokens).float()
    assert_adapters_show(expected, base, bf16_roundings(cfg))
    assert_close(mixed.float(), expected, bf16_roundings(cfg))


@pytest.mark.parametrize("fused_stack", [False, True])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_fused_weights_take_the_adapters_of_their_parts(kind, fused_stack):
    params, cfg = make_model(kind)
    adapters = three_adapters(params, cfg)
    tokens = tokens_for(cfg, 6)
    slots = adapter_slots(stacked(cfg, adapters), ROWS)
    with torch.no_grad():
        expected = ai.forward(params, cfg, tokens, lora=mixed_lora(stacked(cfg, adapters), slots))
        lora = mixed_lora(stacked(cfg, adapters, fused=fused_stack), slots)
        fused = ai.forward(prepare_params(params), cfg, tokens, lora=lora)
        one = ai.forward(prepare_params(params), cfg, tokens[:1], lora=adapters["a"])
    # the same numbers in other layouts and fused products: another summation order
    assert_close(fused, expected, forward_roundings(cfg, 6) + RANK)
    assert_close(one[0], expected[0], forward_roundings(cfg, 6) + RANK)


def test_a_fused_stack_over_unfused_weights_is_an_error():
    params, cfg = make_model("gqa")
    stack = stacked(cfg, three_adapters(params, cfg), fused=True)
    lora = mixed_lora(stack, adapter_slots(stack, ROWS))
    with pytest.raises(ValueError, match=r"holds .*q_proj\.weight fused"):
        ai.forward(params, cfg, tokens_for(cfg, 3), lora=lora)


@pytest.mark.skipif(
    not any(r is None for r in products_here(torch.int8, (64, 32)).values()),
    reason="no int8 product runs here",
)
def test_8_bit_base_weights_add_each_rows_update_in_the_activations_dtype():
    params, cfg = make_model("gqa")
    adapters = three_adapters(params, cfg, size=0.5)  # updates that dwarf bf16's roundings
    stack = stacked(cfg, adapters, fused=True)
    int8 = prepare_params(params, quantize="int8")
    tokens = tokens_for(cfg, 6)
    with torch.no_grad():
        mixed = ai.forward(int8, cfg, tokens, lora=mixed_lora(stack, adapter_slots(stack, ROWS)))
        assert_adapters_show(mixed, ai.forward(int8, cfg, tokens), bf16_roundings(cfg))
        for i, name in enumerate(ROWS):
            lora = None if name is None else adapters[name]
            alone = ai.forward(int8, cfg, tokens[i : i + 1], lora=lora)[0]
            # the same 8-bit products, whose kernel may round activations and outputs to
            # bf16 (weight_only): a batch of another size may round differently
            assert_close(mixed[i], alone, bf16_roundings(cfg))


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_paged_prefill_and_decode_give_each_rows_merged_model(kind):
    params, cfg = make_model(kind)
    adapters = three_adapters(params, cfg)
    stack = stacked(cfg, adapters)
    lora = mixed_lora(stack, adapter_slots(stack, ROWS))
    tokens = tokens_for(cfg, 11)
    pool = init_pages(cfg, 64, 4)
    pool, pages = alloc_pages(pool, len(ROWS) * 3)
    table = torch.tensor(pages).view(len(ROWS), 3)
    with torch.no_grad():
        expected = merged_rows(params, cfg, adapters, tokens)
        logits, pool = prefill(params, cfg, pool, tokens[:, :8], table, 0, lora=lora)
        close = forward_roundings(cfg, 11) + RANK
        assert_close(logits, expected[:, 7], close)
        for t in range(8, 11):
            positions = torch.full((len(ROWS),), t)
            logits, pool = decode_step(params, cfg, pool, tokens[:, t], positions, table, lora)
            assert_close(logits, expected[:, t], close)


def test_the_stack_refuses_what_does_not_fit_by_name():
    params, cfg = make_model("gqa")
    adapters = three_adapters(params, cfg)
    stack = stacked(cfg, adapters, slots=3)
    with pytest.raises(AdapterError, match="'a' is already loaded"):
        stack_adapter(stack, "a", adapters["a"])
    with pytest.raises(AdapterError, match="no free adapter slot for 'd'"):
        stack_adapter(stack, "d", adapters["a"])
    stack = unstack_adapter(stack, "c")
    with pytest.raises(AdapterError, match="rank 8 > 4"):
        stack_adapter(stack, "d", adapter(params, cfg, 8, ("q_proj",), 8.0, 4))
    narrow = init_adapter_stack(cfg, 2, RANK, ("q_proj",))
    with pytest.raises(AdapterError, match=r"'a' adapts .*, which the stack does not hold"):
        stack_adapter(narrow, "a", adapters["a"])
    with pytest.raises(AdapterError, match="'zzz' is not loaded"):
        adapter_slots(stack, ["a", "zzz"])
    with pytest.raises(AdapterError, match="'c' is not loaded"):
        unstack_adapter(stack, "c")


@pytest.mark.parametrize("fused", [False, True])
@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from("abcde")), max_size=14))
def test_slots_hold_what_was_loaded_whatever_the_order(fused, operations):
    params, cfg = make_model("gqa")
    pool = {name: adapter(params, cfg, 1 + i % RANK, ("q_proj", "v_proj"), 2.0 + i, i)
            for i, name in enumerate("abcde")}  # fmt: skip
    stack = init_adapter_stack(cfg, 3, RANK, ("q_proj", "v_proj"), fused=fused)
    for load, name in operations:
        if load and name not in stack["names"] and free_slots(stack):
            stack = stack_adapter(stack, name, pool[name])
        elif not load and name in stack["names"]:
            stack = unstack_adapter(stack, name)
    slots = sorted(stack["names"].values())
    assert len(set(slots)) == len(slots) and set(slots).isdisjoint(free_slots(stack))
    names = [*stack["names"], None]
    x = torch.randn(len(names), 2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    prefix = "model.layers.1.self_attn"
    bound = mixed_lora(stack, adapter_slots(stack, names))
    if fused:  # q, k (no adapter: zeros) and v side by side
        mixed = lora_delta(x, bound, f"{prefix}.qkv_proj.weight")
        mixed = dict(zip(("q", "k", "v"), mixed.split([cfg.hidden_size, 16, 16], dim=-1)))
        assert torch.equal(mixed["k"], torch.zeros_like(mixed["k"]))
    else:
        mixed = {p: lora_delta(x, bound, f"{prefix}.{p}_proj.weight") for p in ("q", "v")}
    for part in ("q", "v"):
        for i, name in enumerate(names):
            row = mixed[part][i]
            if name is None:  # the base model alone: exact zeros
                assert torch.equal(row, torch.zeros_like(row))
            else:
                alone = lora_delta(x[i : i + 1], pool[name], f"{prefix}.{part}_proj.weight")[0]
                scale = alone.abs().max().item()
                torch.testing.assert_close(row, alone, **tolerance(2 * RANK, scale=scale))


@pytest.mark.parametrize("kind", ["gqa", "mla", "moe"])
def test_rows_grouped_by_adapter_give_what_the_masked_product_gives(kind):
    """grouped_lora: each group's rows through its own adapter alone, the same updates as
    masking every adapter per row (another summation order: the masked way adds zeros)."""
    params, cfg = make_model(kind)
    adapters = three_adapters(params, cfg)
    stack = stacked(cfg, adapters)
    slots = adapter_slots(stack, ROWS)
    tokens = tokens_for(cfg, 7)
    with torch.no_grad():
        masked = ai.forward(params, cfg, tokens, lora=mixed_lora(stack, slots))
        grouped = ai.forward(params, cfg, tokens, lora=grouped_lora(stack, slots))
        fused = ai.forward(prepare_params(params), cfg, tokens, lora=grouped_lora(stack, slots))
    assert_close(grouped, masked, forward_roundings(cfg, 7) + RANK)
    assert_close(fused, masked, forward_roundings(cfg, 7) + RANK)
    with pytest.raises(ValueError, match="fused=False"):
        grouped_lora(stacked(cfg, adapters, fused=True), slots)
