"""8-bit weights: each product that runs here against the float one within a worst-case bound
of its rounding, the Engine against recomputation with the same weights for each product, the
error where none runs, and the quality of a trained model (perplexity on held-out text)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from infer_models import BASE, every_int8, greedy_reference, make_model
from numerics import int8_block_half_steps

import astrai as ai
from astrai.infer import Engine, Int8Matrix, kernels_used, prepare, prepare_params, quant, support
from astrai.infer.prepare import fuse_projections
from astrai.infer.quant import BUILDERS, KERNELS, int8_matrix, quantize_rows
from astrai.infer.support import products_here

FLOAT32_EPS = torch.finfo(torch.float32).eps
BF16_UNIT = torch.finfo(torch.bfloat16).eps / 2  # a bf16 rounding's largest relative error
# an x86 CPU older than AVX2 (no fbgemm kernel), as /proc/cpuinfo would list it
PRE_AVX2_FLAGS = frozenset({"sse4_2", "avx"})


def skip_unless_here(kernel: str, shape=None) -> None:
    if reason := products_here(torch.int8, shape)[kernel]:
        pytest.skip(f"the {kernel} int8 product: {reason}")


def error_bound(x: torch.Tensor, w: torch.Tensor, kernel: str) -> torch.Tensor:
    """The worst case of |int8_matrix(w, kernel).linear(x) - x @ w.T|, per output. Each 8-bit
    weight is within half a step (its row's scale / 2) of w; each activation within its own
    rounding of x: a bf16 rounding for weight_only, half the step of the 8-bit activations (7
    bits without VNNI) over the call's range for dynamic, over its block of 32 for gemv; then
    the float rounding of the sum (at most one per term), and for weight_only of its bf16
    scale and bf16 output."""
    q, scale = quantize_rows(w)
    weights = (q.float() * scale[:, None]).abs()
    if kernel == "weight_only":
        activation, output = BF16_UNIT * x.abs(), BF16_UNIT
    elif kernel == "gemv":
        activation, output = int8_block_half_steps(x), 0.0
    else:
        levels = 127 if quant._reduce_range() else 255
        step = (x.max().clamp_min(0) - x.min().clamp_max(0)) / levels
        activation, output = (step / 2).expand_as(x), 0.0
    rounding = (1 + output) ** 2 * (1 + w.shape[1] * FLOAT32_EPS) - 1
    return (
        x.abs().sum(-1, keepdim=True) * scale / 2
        + activation @ weights.T
        + rounding * ((x.abs() + activation) @ weights.T)
    )


# signed: terms that cancel; aligned: all terms of one sign, so each product is as large as
# its worst-case error allows, and a wrong scale shows even at a few percent
VALUES = {"signed": torch.randn, "aligned": torch.rand}


def operands(values: str, rows: int, out_features: int = 48, in_features: int = 96):
    g = torch.Generator().manual_seed(0)
    make = VALUES[values]
    return make(rows, 3, in_features, generator=g), make(out_features, in_features, generator=g)


def test_rows_round_to_the_nearest_step():
    w = torch.randn(64, 96)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5)).all())
    assert bool((q.abs().amax(1) == 127).all())  # each row uses its whole range


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("values", list(VALUES))
@pytest.mark.parametrize("rows", [1, 5])
def test_each_product_is_within_its_worst_case_error(kernel, values, rows):
    skip_unless_here(kernel, (48, 96))
    x, w = operands(values, rows)
    y = int8_matrix(w, kernel).linear(x)
    assert y.shape == (rows, 3, 48) and y.dtype == x.dtype
    assert bool(((y - x @ w.T).abs() <= error_bound(x, w, kernel)).all())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("factor", [0.9, 1.1, 1.25])
def test_a_scale_off_by_ten_percent_is_outside_the_bound(kernel, factor):
    # the bound above is tight enough to catch a product that scales its rows wrongly
    skip_unless_here(kernel, (48, 96))
    x, w = operands("aligned", 5)
    q, scale = quantize_rows(w)
    wrong = Int8Matrix(q, scale * factor, kernel, BUILDERS[kernel](q, scale * factor))
    assert bool(((wrong.linear(x) - x @ w.T).abs() > error_bound(x, w, kernel)).any())


def test_prepare_quantizes_the_matrices_but_not_the_embedding_or_norms():
    params, _ = make_model("gqa")
    prepared = prepare_params(params, quantize="int8")
    assert isinstance(prepared["lm_head.weight"], Int8Matrix)  # tied: a copy of its own
    assert isinstance(prepared["model.layers.0.self_attn.qkv_proj.weight"], Int8Matrix)
    assert prepared["model.embed_tokens.weight"] is params["model.embed_tokens.weight"]
    assert prepared["model.norm.weight"] is params["model.norm.weight"]
    # per layer: q, k and v fused, o, gate and up fused, down
    assert sum(kernels_used(prepared).values()) == 2 * 4 + 1
    with pytest.raises(ValueError, match="quantize"):
        prepare_params(params, quantize="int2")


def one_row_at_a_time(m: Int8Matrix) -> Int8Matrix:
    """The same 8-bit matrix, its product called on each row of its input alone."""

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = [m.run(row[None]) for row in x.reshape(-1, x.shape[-1])]
        return torch.cat(rows).view(*x.shape[:-1], m.shape[0])

    return dataclasses.replace(m, run=run)


# fbgemm's dynamic product scales the activations of a whole call at once, so a row's result
# depends on the rows beside it: there the Engine runs one token per call (one sequence, prompts
# prefilled a token at a time) and the recomputation multiplies each row alone too. The
# weight-only product keeps rows independent, so there the Engine batches and chunks freely.
# Our C kernel quantizes each row's activations alone, so its rows are independent too. MLA's
# up-projection takes every cached latent in one call, so under the dynamic product a key's
# value depends on the latents beside it, which a step and a recomputation group differently:
# the row-independent kernels cover MLA.
ENGINE_CALLS = {
    "weight_only": {"max_batch": 4},
    "dynamic": {"max_batch": 1, "prefill_chunk": 1},
    "gemv": {"max_batch": 4},
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_engine_matches_recomputation_with_the_same_8_bit_weights(kind, kernel, monkeypatch):
    skip_unless_here(kernel)
    if (kind, kernel) == ("mla", "dynamic"):
        pytest.skip("a cached latent's up-projection depends on the call's other latents")
    monkeypatch.setattr(prepare, "int8_products", every_int8(kernel))
    params, cfg = make_model(kind)
    reference = prepare_params(params, quantize="int8")
    assert set(kernels_used(reference)) == {kernel}
    reference = {
        k: one_row_at_a_time(w) if isinstance(w, Int8Matrix) else w for k, w in reference.items()
    }
    prompts = [[5, 17, 42, 8], [100, 3, 250, 77, 9, 11]]
    with Engine(params, cfg, None, quantize="int8", page_size=4, **ENGINE_CALLS[kernel]) as e:
        outs = e.generate(prompts, max_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(reference, cfg, prompt, 12)


def narrow_model():
    """The tests' tiny model at width 24: rows the weight-only kernel cannot take."""
    cfg = ai.ModelConfig(**(BASE | {"hidden_size": 24, "intermediate_size": 48}))
    return ai.init_params(cfg, seed=0), cfg


def test_a_width_one_product_cannot_take_is_multiplied_by_another():
    skip_unless_here("dynamic", (48, 24))
    params, cfg = narrow_model()
    prepared = prepare_params(params, quantize="int8")
    matrices = [w for w in prepared.values() if isinstance(w, Int8Matrix)]
    others = {name for name, why in products_here(torch.int8, (48, 24)).items() if why is None}
    assert "weight_only" not in others
    assert {w.kernel for w in matrices if w.shape[1] == 24} <= others
    assert {w.split[1] for w in matrices if w.shape[1] == 24 and w.split} <= others
    logits = ai.forward(prepared, cfg, torch.tensor([[1, 2, 3, 4]]))
    assert logits.shape == (1, 4, cfg.vocab_size) and bool(logits.isfinite().all())


def test_no_8_bit_product_here_is_an_error_naming_each_and_why(monkeypatch, fresh_choices):
    # a CPU without AVX2 (no fbgemm kernel), and rows the weight-only kernel cannot take
    monkeypatch.setattr(support, "cpu_flags", lambda: PRE_AVX2_FLAGS)
    params, cfg = narrow_model()
    with pytest.raises(ValueError, match=r"no int8 product .*\(weight_only: .*multiple of 16"):
        Engine(params, cfg, None, quantize="int8")
    with pytest.raises(ValueError, match=r"dynamic: needs the CPU feature avx2"):
        prepare_params(params, quantize="int8")


CHOICE = torch.tensor([0.7, 0.1, 0.1, 0.1])


def markov_text(rows: int, length: int, seed: int, vocab: int = 64) -> torch.Tensor:
    """Token rows from a fixed random Markov chain in which each token has four successors, one
    of them likely (0.7): the best greedy choice is clear, not a tie."""
    table = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, length, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    for t in range(1, length):
        pick = torch.multinomial(CHOICE.expand(rows, 4), 1, generator=g)[:, 0]
        out[:, t] = table[out[:, t - 1], pick]
    return out


def perplexity(params, cfg, tokens: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = ai.forward(params, cfg, tokens[:, :-1])
        return float(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).exp())


@pytest.fixture(scope="module")
def trained():
    """A small model trained on the Markov chain for 150 steps (a few seconds on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small products on a busy machine: more threads only contend
    try:
        torch.manual_seed(0)
        cfg = ai.ModelConfig(
            vocab_size=64,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
        )
        params = {k: v.clone().requires_grad_() for k, v in ai.init_params(cfg, seed=0).items()}
        opt = torch.optim.Adam(params.values(), lr=3e-3)
        for step in range(150):
            batch = markov_text(16, 33, seed=1 + step)
            logits = ai.forward(params, cfg, batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        return {k: v.detach() for k, v in params.items()}, cfg
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", [None, *KERNELS])  # None: the one measured fastest here
def test_a_trained_model_keeps_its_perplexity_and_greedy_choices_in_8_bits(trained, kernel):
    if kernel is not None:
        skip_unless_here(kernel)
    params, cfg = trained
    held_out = markov_text(32, 33, seed=10_000)
    full = perplexity(params, cfg, held_out)
    assert full < 6  # it learnt the chain (2.6 at best, 64 knowing nothing)
    int8 = prepare_params(params, quantize="int8")
    if kernel is not None:  # the same 8-bit matrices, run by the kernel under test
        source = fuse_projections(params)
        int8 = {
            k: int8_matrix(source.get(k, params["model.embed_tokens.weight"]), kernel)
            if isinstance(w, Int8Matrix)
            else w
            for k, w in int8.items()
        }
    assert abs(perplexity(int8, cfg, held_out) - full) / full < 0.01
    with torch.inference_mode():
        a = ai.forward(params, cfg, held_out).argmax(-1)
        b = ai.forward(int8, cfg, held_out).argmax(-1)
    assert float((a == b).float().mean()) >= 0.98


def test_our_kernel_picks_the_tokens_torchs_products_pick(trained):
    # not the same bits: gemv rounds activations to int8 per block of 32, weight_only to bf16,
    # so a position whose two best logits lie within that rounding may go either way; on the
    # trained chain (one successor at 0.7) that is rare
    skip_unless_here("gemv")
    skip_unless_here("weight_only")
    params, cfg = trained
    held_out = markov_text(32, 33, seed=10_000)
    source = fuse_projections(params)
    choices = {}
    for kernel in ("gemv", "weight_only"):
        prepared = prepare_params(params, quantize="int8")
        prepared = {
            k: int8_matrix(source.get(k, params["model.embed_tokens.weight"]), kernel)
            if isinstance(w, Int8Matrix)
            else w
            for k, w in prepared.items()
        }
        with torch.inference_mode():
            choices[kernel] = ai.forward(prepared, cfg, held_out).argmax(-1)
    assert float((choices["gemv"] == choices["weight_only"]).float().mean()) >= 0.99


def test_a_split_matrix_runs_one_product_up_to_its_rows_and_the_other_beyond():
    skip_unless_here("gemv", (48, 96))
    skip_unless_here("weight_only", (48, 96))
    _, w = operands("signed", 1)
    x = torch.randn(5, 96)
    split = int8_matrix(w, "gemv", (4, "weight_only"))
    assert split.product == "gemv up to 4 rows, then weight_only"
    few, many = int8_matrix(w, "gemv"), int8_matrix(w, "weight_only")
    assert torch.equal(split.linear(x[:4]), few.linear(x[:4]))
    assert torch.equal(split.linear(x), many.linear(x))
    assert not torch.equal(few.linear(x), many.linear(x))  # so the two above tell them apart
    assert torch.equal(split.linear(x[:2, None]), few.linear(x[:2, None]))  # rows of any shape


@pytest.mark.parametrize(
    "seconds, choice",
    [
        ({"a": (1, 1, 9), "b": (2, 2, 3)}, ("a", (4, "b"))),  # a up to 4 rows, b at 16
        ({"a": (1, 3, 9), "b": (2, 2, 3)}, ("a", (1, "b"))),  # a at one row only
        ({"a": (1, 2, 3), "b": (2, 3, 4)}, ("a", None)),  # a everywhere
        ({"a": (2, 1, 9), "b": (1, 2, 3)}, ("b", None)),  # b at 1 and 16 rows: no split
    ],
)
def test_the_int8_choice_splits_where_another_product_wins_at_more_rows(
    seconds, choice, monkeypatch, fresh_choices
):
    time_products(monkeypatch, seconds)
    head = {"lm_head.weight": torch.zeros(8, 16)}
    assert prepare.int8_products(head, Counter({(8, 16): 2})) == {(8, 16): choice}


def time_products(monkeypatch, seconds: dict[str, tuple]):
    """Products named as `seconds` keys run here, each taking its seconds a pass at each of
    SPLIT_ROWS rows."""
    at = {rows: i for i, rows in enumerate(prepare.SPLIT_ROWS)}
    monkeypatch.setattr(prepare, "runnable", lambda *args: list(seconds))
    monkeypatch.setattr(prepare, "BUILDERS", {name: lambda q, s, n=name: n for name in seconds})
    monkeypatch.setattr(prepare, "pass_seconds", lambda runs, x: seconds[runs[0]][at[x.shape[0]]])


@pytest.mark.parametrize(
    "behind, layers_take",
    [
        (50e-6, ("gemv", (1, "dynamic"))),  # 100 us a layer: within the budget
        (150e-6, ("dynamic", None)),  # 300 us a layer: beyond it
    ],
)
def test_the_layers_keep_our_product_at_one_row_within_the_one_call_budget(
    behind, layers_take, monkeypatch, fresh_choices
):
    assert prepare.LAYER_SECONDS == 200e-6  # the figures above are set against it
    fast = (1e-3, 1e-3, 1e-3)
    time_products(monkeypatch, {"dynamic": fast, "gemv": (1e-3 + behind, 2e-3, 9e-3)})
    matrices = {
        "model.layers.0.self_attn.qkv_proj.weight": torch.zeros(8, 16),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(16, 8),
        "model.layers.1.self_attn.qkv_proj.weight": torch.zeros(8, 16),
        "model.layers.1.mlp.down_proj.weight": torch.zeros(16, 8),
        "lm_head.weight": torch.zeros(24, 16),
    }
    copies = Counter({(8, 16): 1, (16, 8): 1, (24, 16): 1})
    choices = prepare.int8_products(matrices, copies)
    assert choices == {(8, 16): layers_take, (16, 8): layers_take, (24, 16): ("dynamic", None)}


def test_the_layers_keep_the_fastest_product_where_ours_does_not_run(monkeypatch, fresh_choices):
    time_products(monkeypatch, {"dynamic": (1e-3, 1e-3, 1e-3)})
    matrices = {"model.layers.0.mlp.down_proj.weight": torch.zeros(16, 8)}
    assert prepare.int8_products(matrices, Counter({(16, 8): 1})) == {(16, 8): ("dynamic", None)}
