"""A prompt's attention under a mask (astrai/kernels/prompt_attention.c) against the same
attention in float64: causal prompts, chunks after cached keys, sliding windows, scattered masks,
a mask per batch row, grouped heads, head sizes, row counts no block divides; what it does not
take refused by name; and a paged prefill through it giving the logits of one through torch's
kernels."""

from __future__ import annotations

import math

import pytest
import torch
from infer_models import make_model
from numerics import tolerance

from astrai.infer import alloc_pages, init_pages, prefill
from astrai.kernels import prompt_attention
from astrai.kernels.prompt_attention import masked_attention, takes
from astrai.model import masked_attention as attention_paths

pytestmark = pytest.mark.skipif(
    not prompt_attention.runs_here(), reason="the prompt attention kernel takes AVX-512"
)


def reference(q, k, v, mask, scale):
    """softmax(q k^T scale, masked) v in float64, each K/V head repeated for its query heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    return scores.masked_fill(~mask, -math.inf).softmax(-1) @ v


def assert_float32_close(got: torch.Tensor, expected: torch.Tensor, roundings: int) -> None:
    """got (float32) within `roundings` float32 roundings of the float64 expected values."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got.double(), expected, **tolerance(roundings, torch.float32, scale))


def mask_of(kind: str, B: int, T: int, S: int, g: torch.Generator) -> torch.Tensor:
    """bool [B or 1, 1, T, S]: the queries are the last T of S positions."""
    position = torch.arange(T)[:, None] + (S - T)
    key = torch.arange(S)[None]
    causal = key <= position
    if kind == "causal":
        return causal[None, None]
    if kind == "window":  # the last 13 keys of each position
        return (causal & (key > position - 13))[None, None]
    scattered = torch.rand(B, 1, T, S, generator=g) < 0.3
    scattered[..., 0] = True  # a key every row
    return scattered & causal if kind == "scattered causal" else scattered


# (B, H, Hkv, T, S, D): a square prompt, a chunk after cached keys, one row, rows and keys no
# block of 4 rows or 16 keys divides, heads no vector of 16 divides, grouped heads (7 query heads
# a K/V head, as the 0.5B model)
SHAPES = [
    (1, 2, 1, 8, 8, 16),
    (2, 4, 2, 37, 50, 32),
    (1, 14, 2, 70, 200, 64),
    (3, 2, 2, 1, 9, 8),
    (2, 4, 2, 9, 13, 24),
    (1, 4, 1, 130, 130, 128),
]


@pytest.mark.parametrize("kind", ["causal", "window", "scattered", "scattered causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_is_float64_attention_within_float32_rounding(shape, kind):
    B, H, Hkv, T, S, D = shape
    g = torch.Generator().manual_seed(T * S + D)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    mask = mask_of(kind, B, T, S, g)
    scale = D**-0.5
    additive = torch.zeros(mask.shape).masked_fill(~mask, -math.inf)  # as a paged prefill's
    expected = reference(q, k, v, mask, scale)
    for given in (mask, additive):
        got = masked_attention(q, k, v, given, scale)
        assert got.shape == (B, H, T, D) and got.dtype == torch.float32
        # float32 scores over D terms, a softmax's sums over S keys, exp a few roundings off
        assert_float32_close(got, expected, D + 2 * S + 8)


def test_bfloat16_inputs_are_widened_and_the_output_rounded_once():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 4, 10, 32, generator=g).bfloat16() for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    mask = mask_of("causal", 2, 10, 10, g)
    additive = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(~mask, -math.inf)
    expected = reference(q, k, v, mask, 32**-0.5)
    for given in (mask, additive):
        got = masked_attention(q, k, v, given, None)
        assert got.dtype == torch.bfloat16
        # the float32 result within float32's roundings, then one bfloat16 rounding
        bound = 2**-8 * expected.abs() + (32 + 2 * 10 + 8) * 2**-23 * max(1, expected.abs().max())
        assert bool(((got.double() - expected).abs() <= bound).all())


def test_an_additive_mask_adds_its_values_to_the_scores():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(3))
    bias = torch.randn(1, 1, 9, 9, generator=g).masked_fill(
        ~mask_of("causal", 1, 9, 9, g), -math.inf
    )
    expected = (q.double() @ k.double().transpose(-1, -2) * 0.25 + bias).softmax(-1) @ v.double()
    assert_float32_close(masked_attention(q, k, v, bias, 0.25), expected, 16 + 2 * 9 + 8)


def test_strided_inputs_and_a_mask_per_row_of_the_batch():
    # q as attention has it (heads transposed out of [B, T, H, D]); each batch row its mask
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 11, 4, 32, generator=g).transpose(1, 2)
    k, v = (torch.randn(2, 2, 11, 32, generator=g) for _ in range(2))
    mask = mask_of("scattered", 2, 11, 11, g)
    got = masked_attention(q, k, v, mask, 0.3)
    assert_float32_close(got, reference(q, k, v, mask, 0.3), 32 + 2 * 11 + 8)


def test_what_it_does_not_take_is_refused_by_name():
    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 1, 4, 16)
    mask = mask_of("causal", 1, 4, 4, torch.Generator())
    assert takes(q, k, k, mask)
    for bad in (
        (q.half(), k.half(), k.half(), mask),  # float32 or bfloat16 only
        (
            q.new_zeros(1, 2, 4, 272),
            k.new_zeros(1, 1, 4, 272),
            k.new_zeros(1, 1, 4, 272),
            mask,
        ),  # past MAX_DIM
        (q, k, k, torch.zeros(1, 1, 4, 4, dtype=torch.float64)),  # a float64 mask
        (q, k, k, mask[..., :3]),  # a mask of other keys
    ):
        assert not takes(*bad)
    with pytest.raises(ValueError, match="the prompt attention kernel does not take"):
        masked_attention(q.half(), k.half(), k.half(), mask, None)


def test_a_paged_prefill_through_it_gives_the_logits_of_torchs_kernels(monkeypatch):
    params, cfg = make_model("gqa")
    prompts = torch.randint(0, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(3))
    logits, calls = {}, []
    monkeypatch.setattr(
        attention_paths, "prompt_kernel", lambda *args: calls.append(1) or masked_attention(*args)
    )
    for ours in (True, False):
        monkeypatch.setattr(attention_paths, "kernel_wins", lambda *shape, won=ours: won)
        pool, pages = alloc_pages(init_pages(cfg, 16, 4), 12)
        with torch.no_grad():
            logits[ours], _ = prefill(params, cfg, pool, prompts, torch.tensor(pages).view(2, 6), 0)
        assert bool(calls) == ours  # each layer's prompt attention: ours, then torch's
        calls.clear()
    scale = max(1.0, logits[False].abs().max().item())
    roundings = cfg.num_hidden_layers * (cfg.dim_per_head + 2 * 21 + 8)
    torch.testing.assert_close(
        logits[True], logits[False], **tolerance(roundings, torch.float32, scale)
    )
