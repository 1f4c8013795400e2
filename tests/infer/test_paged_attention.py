"""Decode attention over the pages in place (astrai/kernels/attention.c) against attention over
the same keys gathered and computed in float64: float32 and bfloat16 pools, grouped heads, head
sizes, page sizes, rows of different lengths on scattered pages, sliding windows; bad calls
refused by name; a decode step through it equal to one that gathers the pages; and a plain
layer's attention in one call (rotate, store, attend) writing the pages and giving the logits of
the layer-by-layer way."""

from __future__ import annotations

import pytest
import torch
from infer_models import BASE, CONFIGS
from numerics import assert_close, tolerance

import astrai as ai
import astrai.infer.paged as paged
from astrai.infer import alloc_pages, decode_step, init_pages, prefill, prepare_params
from astrai.kernels import build
from astrai.kernels.paged_attention import PagedMask, paged_attention, runs_here
from astrai.model import attention

pytestmark = pytest.mark.skipif(
    build.kernel_library() is None, reason=f"our C kernels are absent: {build.why_absent()}"
)


def pool_layer(pages: int, page_size: int, kv_heads: int, dim: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(pages, page_size, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(pages, page_size, kv_heads, dim, generator=g).to(dtype)
    return k, v


def reference(q, k, v, table, keys, window, scale):
    """softmax(q k^T scale) v in float64 over each row's visible keys, gathered."""
    B, H, _, D = q.shape
    kv_heads, page_size = k.shape[2], k.shape[1]
    out = torch.empty(B, H, 1, D, dtype=torch.float64)
    for b in range(B):
        n = int(keys[b])
        first = max(0, n - window) if window else 0
        positions = torch.arange(first, n)
        slots = table[b, positions // page_size] * page_size + positions % page_size
        ks = k.flatten(0, 1)[slots].double()  # [n, Hkv, D]
        vs = v.flatten(0, 1)[slots].double()
        for h in range(H):
            g = h // (H // kv_heads)
            weights = torch.softmax(ks[:, g] @ q[b, h, 0].double() * scale, 0)
            out[b, h, 0] = weights @ vs[:, g]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,page_size",
    [(4, 4, 8, 1), (14, 2, 64, 16), (8, 2, 128, 4), (6, 1, 24, 3)],
)
@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_matches_gathered_attention_in_float64(
    dtype, heads, kv_heads, dim, page_size, window
):
    pages, B = 40, 4
    k, v = pool_layer(pages, page_size, kv_heads, dim, dtype, seed=dim + page_size)
    g = torch.Generator().manual_seed(1)
    keys = torch.tensor([1, page_size, 2 * page_size + 1, 37])  # one key, a full page, more
    width = (int(keys.max()) - 1) // page_size + 1
    table = torch.stack([torch.randperm(pages, generator=g)[:width] for _ in range(B)])
    # q as a decode step has it: [B, H, 1, D], a view of [B, 1, H + Hkv, D] split
    qk = torch.randn(B, 1, heads + kv_heads, dim, generator=g)
    q = qk[:, :, :heads].transpose(1, 2)
    scale = dim**-0.5
    got = paged_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), PagedMask(table, keys, window), scale
    )
    assert got.shape == (B, heads, 1, dim) and got.dtype == q.dtype
    expected = reference(q, k, v, table, keys, window, scale)
    # float32 scores over dim terms, sums over the keys, and an exp a few roundings off
    roundings = dim + 2 * int(keys.max()) + 8
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got.double(), expected, **tolerance(roundings, torch.float32, scale))


def test_bad_calls_are_refused_by_name():
    k, v = pool_layer(4, 4, 2, 16, torch.float32, seed=0)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    q = torch.randn(1, 4, 1, 16)
    table = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="names a page the pool lacks"):
        paged_attention(q, kt, vt, PagedMask(torch.tensor([[0, 9]]), torch.tensor([6])), None)
    with pytest.raises(RuntimeError, match="no key, or more than its pages hold"):
        paged_attention(q, kt, vt, PagedMask(table, torch.tensor([9])), None)
    with pytest.raises(RuntimeError, match="no key"):
        paged_attention(q, kt, vt, PagedMask(table, torch.tensor([0])), None)
    with pytest.raises(ValueError, match="one query row per sequence"):
        paged_attention(torch.randn(1, 4, 2, 16), kt, vt, PagedMask(table, torch.tensor([3])), None)
    with pytest.raises(ValueError, match="views of the pool"):
        paged_attention(q, k, v, PagedMask(table, torch.tensor([3])), None)
    with pytest.raises(ValueError, match="2 rows"):
        paged_attention(torch.randn(2, 4, 1, 16), kt, vt, PagedMask(table, torch.tensor([3])), None)
    assert not runs_here(torch.float32, 12, torch.device("cpu"))  # heads 8 wide or more
    assert not runs_here(torch.float16, 16, torch.device("cpu"))


MODELS = {
    "gqa": CONFIGS["gqa"],
    "gqa_variants": CONFIGS["gqa_variants"],  # QK norm, gated attention, biases
    "sliding": ai.ModelConfig(
        **BASE, sliding_window=3, layer_types=("sliding_attention", "full_attention")
    ),
}


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_reading_pages_in_place_matches_one_gathering_them(kind, dtype, monkeypatch):
    cfg = MODELS[kind]
    params = {name: t.to(dtype) for name, t in ai.init_params(cfg, seed=0).items()}
    lengths = torch.tensor([9, 6, 3])
    tokens = torch.randint(1, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    steps = []
    for in_place in (True, False):
        assert paged._reads_pages_in_place(cfg, init_pages(cfg, 1, 4, dtype, "cpu"), tokens[:, :1])
        if not in_place:
            monkeypatch.setattr(paged, "_reads_pages_in_place", lambda *args: False)
        pool = init_pages(cfg, 12, 4, dtype, "cpu")
        pool, pages = alloc_pages(pool, 12)
        table = torch.tensor(pages).view(3, 4).flip(1)  # pages out of order
        _, pool = prefill(params, cfg, pool, tokens, table, 0, lengths)
        logits, pool = decode_step(params, cfg, pool, tokens[:, 0], lengths, table)
        steps.append(logits)
    # The same products on the same inputs; only attention sums in another order: per layer, a
    # rounding per score term and per key twice in float32, one of its output in bfloat16.
    per_layer = cfg.dim_per_head + 2 * 10 if dtype == torch.float32 else 4
    scale = max(1.0, steps[1].abs().max().item())
    torch.testing.assert_close(
        steps[0], steps[1], **tolerance(cfg.num_hidden_layers * per_layer, dtype, scale)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_plain_layer_attends_in_one_call_and_writes_the_same_pages(dtype, monkeypatch):
    # astrai_paged_decode rotates, stores and attends in one call; layer by layer, torch rotates
    # and stores and the kernel attends: the same pages and logits, step after step
    cfg = MODELS["sliding"]  # plain GQA: one sliding-window layer, one full
    params = prepare_params({name: t.to(dtype) for name, t in ai.init_params(cfg, seed=1).items()})
    tokens = torch.randint(1, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    calls, real = [], attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention", lambda *a: calls.append(1) or real(*a))
    runs = []
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(attention, "_plain", lambda *args: False)
        pool = init_pages(cfg, 8, 4, dtype, "cpu")
        pool, pages = alloc_pages(pool, 8)
        table = torch.tensor(pages).view(2, 4).flip(1)
        _, pool = prefill(params, cfg, pool, tokens[:, :5], table, 0)
        steps = []
        for position in range(5, 12):  # the fixed next tokens: both runs see the same inputs
            logits, pool = decode_step(
                params, cfg, pool, tokens[:, position], torch.tensor([position] * 2), table
            )
            steps.append(logits)
        runs.append((torch.stack(steps), pool))
    assert len(calls) == 7 * cfg.num_hidden_layers  # every layer of every step took one call
    (fused, fused_pool), (layered, layered_pool) = runs
    # RoPE rounds once more or less (an FMA); in bfloat16 a value may land one step apart
    roundings = 4 if dtype == torch.float32 else 2
    for key in ("k", "v"):
        assert_close(fused_pool[key], layered_pool[key], roundings)
    per_layer = cfg.dim_per_head + 2 * 12 if dtype == torch.float32 else 4
    scale = max(1.0, layered.abs().max().item())
    torch.testing.assert_close(
        fused, layered, **tolerance(cfg.num_hidden_layers * per_layer * 7, dtype, scale)
    )
