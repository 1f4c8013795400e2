"""4-bit weights: the rounding to levels, each product that runs here at each group size against
the float one within a worst-case bound of its rounding, the Engine against recomputation with
the same weights, the error where none runs, and the quality of a trained model."""

from __future__ import annotations

import pytest
import torch
from infer_models import BASE, greedy_loop, greedy_reference, make_model
from numerics import int8_block_half_steps
from test_int8 import markov_text, perplexity, trained  # noqa: F401 (a fixture)

import astrai as ai
from astrai.infer import Engine, Int4Matrix, kernels_used, prepare, prepare_params
from astrai.infer.int4 import (
    BUILDERS,
    GROUPS,
    KERNELS,
    ROADS,
    dense_dtype,
    dequantize,
    groups_for,
    int4_matrix,
    quantize_groups,
)
from astrai.infer.support import products_here
from astrai.kernels import gemv

FLOAT32_EPS = torch.finfo(torch.float32).eps
BF16_UNIT = torch.finfo(torch.bfloat16).eps / 2  # a bf16 rounding's largest relative error
PRODUCTS = [(kernel, group) for kernel in KERNELS for group in GROUPS]


def skip_unless_here(kernel: str, shape=None) -> None:
    if reason := products_here(torch.int4, shape)[kernel]:
        pytest.skip(f"the {kernel} int4 product: {reason}")


def steps(scale: torch.Tensor, in_features: int) -> torch.Tensor:
    """Each weight's step: its group's scale, [out, in]."""
    return scale.repeat_interleave(in_features // scale.shape[1], dim=1)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize(
    "make",
    [
        torch.randn,
        lambda *shape: torch.rand(*shape) + 1000.0,  # far from zero: the zero point's rounding
        lambda *shape: torch.zeros(*shape),
        lambda *shape: torch.full(shape, -3.7),
    ],
    ids=["signed", "offset", "zeros", "constant"],
)
def test_groups_round_to_the_nearest_level(group, make):
    torch.manual_seed(0)
    w = make(40, 2 * group)
    q, scale, zero = quantize_groups(w, group)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == (40, 2)
    for t in (scale, zero):  # the kernel reads them in bfloat16: they are bfloat16 values
        assert torch.equal(t, t.to(torch.bfloat16).float())
    err = (dequantize(q, scale, zero) - w).abs()
    assert bool((err <= steps(scale, w.shape[1]) / 2 * (1 + 1e-5)).all())


def test_a_signed_group_uses_its_levels():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    q, _, _ = quantize_groups(w, 32)
    per_group = q.view(64, 4, 32)
    # the group's extremes sit at most one level inside the ends (the scale rounds up)
    assert int(per_group.amin(-1).max()) <= 1 and int(per_group.amax(-1).min()) >= 14


def test_a_width_no_group_divides_is_refused():
    with pytest.raises(ValueError, match="in_features 40 is not a multiple of the group 32"):
        quantize_groups(torch.randn(8, 40), 32)
    with pytest.raises(ValueError, match="group must be one of"):
        int4_matrix(torch.randn(8, 48), "weight_only", 48)
    with pytest.raises(ValueError, match="unknown int4 kernel"):
        int4_matrix(torch.randn(8, 64), "fast", 32)


def error_bound(x: torch.Tensor, w: torch.Tensor, group: int, kernel: str) -> torch.Tensor:
    """The worst case of |int4_matrix(w, kernel, group).linear(x) - x @ w.T|, per output. Each
    4-bit weight is within half its group's step of w. weight_only rounds the activations to
    bf16, dequantizes each weight ((q - 8) * scale + zero: two float32 roundings), sums in
    float32 (at most one rounding per term) and rounds the sum to bf16. gemv rounds each
    activation to int8 levels of its block (gemv.activation_block: within half the block's
    step), sums the integer products exactly and scales them in float32, as q * scale and
    (zero - 8 * scale) apart: terms up to |q * scale| + |zero - 8 * scale| <= 2 |W| + 30 * scale
    each."""
    q, scale, zero = quantize_groups(w, group)
    weights = dequantize(q, scale, zero).abs()
    step = steps(scale, w.shape[1])
    if kernel == "gemv":
        block = gemv.activation_block(group)
        activation, output, terms = int8_block_half_steps(x, block), 0.0, 2 * weights + 30 * step
    else:
        activation, output, terms = BF16_UNIT * x.abs(), BF16_UNIT, weights
    rounding = (1 + output) * (1 + (w.shape[1] + 2) * FLOAT32_EPS) - 1
    return (
        x.abs() @ (step / 2).T
        + activation @ weights.T
        + rounding * ((x.abs() + activation) @ terms.T)
    )


VALUES = {"signed": torch.randn, "aligned": torch.rand}


def operands(values: str, rows: int, out_features: int = 40, in_features: int = 256):
    g = torch.Generator().manual_seed(0)
    make = VALUES[values]
    return make(rows, 3, in_features, generator=g), make(out_features, in_features, generator=g)


@pytest.mark.parametrize("kernel,group", PRODUCTS)
@pytest.mark.parametrize("values", list(VALUES))
@pytest.mark.parametrize("rows", [1, 5])
def test_each_product_is_within_its_worst_case_error(kernel, group, values, rows):
    skip_unless_here(kernel, (40, 256))
    x, w = operands(values, rows)
    y = int4_matrix(w, kernel, group).linear(x)
    assert y.shape == (rows, 3, 40) and y.dtype == x.dtype
    assert bool(((y - x @ w.T).abs() <= error_bound(x, w, group, kernel)).all())


@pytest.mark.parametrize("kernel,group", PRODUCTS)
@pytest.mark.parametrize("factor", [0.9, 1.1, 1.25])
def test_groups_off_by_ten_percent_are_outside_the_bound(kernel, group, factor):
    # the bound above is tight enough to catch a product that scales its groups wrongly
    skip_unless_here(kernel, (40, 256))
    x, w = operands("aligned", 5)
    q, scale, zero = quantize_groups(w, group)
    _, run = BUILDERS[kernel](q, scale * factor, zero * factor, group)
    wrong = Int4Matrix(None, scale * factor, zero * factor, group, kernel, run)
    assert bool(((wrong.linear(x) - x @ w.T).abs() > error_bound(x, w, group, kernel)).any())


@pytest.mark.parametrize(
    "shape, group", [((40, 256), 32), ((41, 96), 32), ((3, 64), 64), ((40, 384), 128)]
)
def test_the_gemv_packing_dequantizes_to_the_weights_bit_for_bit(shape, group):
    skip_unless_here("gemv", shape)
    q, scale, zero = quantize_groups(torch.randn(*shape) + 0.1, group)
    nibbles, _, _ = gemv.pack_int4(q, scale, zero, group)
    weights = dequantize(q, scale, zero)
    for dtype in (torch.float32, torch.bfloat16):
        whole = gemv.int4_dequantize(nibbles, scale, zero, group, range(shape[0]), shape[1], dtype)
        some = gemv.int4_dequantize(nibbles, scale, zero, group, range(1, 3), shape[1], dtype)
        assert torch.equal(whole, weights.to(dtype)) and torch.equal(some, weights[1:3].to(dtype))


def dense_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x @ w.T| off by the dense road's roundings: x and w to its dtype (a unit each), a
    float32 sum in any order, the result to its dtype and to x's."""
    unit = torch.finfo(dense_dtype(x.dtype, x.device)).eps / 2
    terms = x.abs().double() @ w.abs().double().T
    return (4 * unit + (w.shape[1] + 2) * FLOAT32_EPS) * terms + torch.finfo(x.dtype).tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [1 << 22, 96 * 3])  # one slice of outputs, or 3 rows each
def test_the_dense_road_multiplies_the_dequantized_weights(dtype, chunk, monkeypatch):
    skip_unless_here("gemv", (41, 96))
    monkeypatch.setattr("astrai.infer.int4.DENSE_CHUNK", chunk)
    x, w = operands("signed", 70, out_features=41, in_features=96)
    x = x.to(dtype)
    dense = int4_matrix(w, "gemv", 32, split=0)
    assert dense.product == "int4 gemv/32 up to 0 rows, then dense"
    weights = dequantize(*quantize_groups(w, 32))
    expected = x.double() @ weights.double().T
    y = dense.linear(x)
    assert y.shape == (70, 3, 41) and y.dtype == dtype
    assert bool(((y.double() - expected).abs() <= dense_bound(x, weights)).all())


def skip_unless_road_here(road: str) -> None:
    skip_unless_here("gemv")
    if road == "gemm" and gemv.isa() < 2:
        pytest.skip("the gemm road takes AVX-512 VNNI, which this CPU lacks")


@pytest.mark.parametrize("road", ROADS)
def test_a_split_matrix_takes_gemv_up_to_its_rows_and_its_road_beyond(road, monkeypatch):
    skip_unless_road_here(road)
    taken = []  # the row counts the road multiplied

    def counted(*args, build=ROADS[road]):
        run = build(*args)
        return lambda x, *rest, **named: taken.append(len(x)) or run(x, *rest, **named)

    monkeypatch.setitem(ROADS, road, counted)
    x, w = operands("signed", 4)
    split, few, many = (int4_matrix(w, "gemv", 32, s, road) for s in (6, None, 0))
    assert split.product == f"int4 gemv/32 up to 6 rows, then {road}"
    rows = x.flatten(0, 1)  # 12 rows
    assert torch.equal(split.linear(rows[:6]), few.linear(rows[:6])) and taken == []
    assert torch.equal(split.linear(rows[:7]), many.linear(rows[:7])) and taken == [7, 7]
    # gemm sums what gemv sums in the same order: the same bits; the dense road rounds apart
    assert torch.equal(many.linear(rows[:7]), few.linear(rows[:7])) == (road == "gemm")
    with pytest.raises(ValueError, match="only the gemv int4 product splits"):
        int4_matrix(w, "weight_only", 32, 6)
    with pytest.raises(ValueError, match="unknown int4 road 'sparse'; one of dense, gemm"):
        int4_matrix(w, "gemv", 32, 6, "sparse")


@pytest.mark.parametrize("road", ROADS)
def test_engine_prompts_on_a_road_match_a_prefill_and_decode_loop(road, monkeypatch):
    # a prompt of more than 2 rows takes the road, a decode step gemv; each rounds its own way
    # (gemv and gemm their activations to int8, summed in other orders), so the reference takes
    # the same roads: a prefill and decode steps rather than recomputation of every prefix, one
    # request at a time (a step that carries one request's token beside another's prompt takes
    # the road)
    skip_unless_road_here(road)
    monkeypatch.setattr(prepare, "fastest_int4", lambda *shape: ("gemv", 32, 2, road))
    params, cfg = make_model("gqa")
    reference = prepare_params(params, quantize="int4")
    assert set(kernels_used(reference)) == {f"int4 gemv/32 up to 2 rows, then {road}"}
    prompts = [[5, 17, 42, 8], [100, 3, 250, 77, 9, 11]]
    with Engine(params, cfg, None, quantize="int4", page_size=4, max_batch=4) as e:
        for prompt in prompts:
            (out,) = e.generate([prompt], max_tokens=12, temperature=0.0, ignore_eos=True)
            assert out.token_ids == greedy_loop(reference, cfg, prompt, 12)


def test_prepare_quantizes_the_matrices_but_not_the_embedding_or_norms():
    skip_unless_here("weight_only")
    params, _ = make_model("gqa")
    prepared = prepare_params(params, quantize="int4")
    assert isinstance(prepared["lm_head.weight"], Int4Matrix)  # tied: a copy of its own
    assert prepared["lm_head.weight"].shape == params["model.embed_tokens.weight"].shape
    assert isinstance(prepared["model.layers.0.self_attn.qkv_proj.weight"], Int4Matrix)
    assert prepared["model.embed_tokens.weight"] is params["model.embed_tokens.weight"]
    assert prepared["model.norm.weight"] is params["model.norm.weight"]
    assert sum(kernels_used(prepared).values()) == 2 * 4 + 1
    assert all(name.startswith("int4 ") for name in kernels_used(prepared))


@pytest.mark.parametrize("kernel,group", [(k, g) for k, g in PRODUCTS if g <= BASE["hidden_size"]])
@pytest.mark.parametrize("kind", ["gqa", "gqa_variants"])  # MLA's 16-wide matrices take none
def test_engine_matches_recomputation_with_the_same_4_bit_weights(kind, kernel, group, monkeypatch):
    # the tests' models are 32 wide: the only group size that divides them is 32
    skip_unless_here(kernel)
    monkeypatch.setattr(prepare, "fastest_int4", lambda *shape: (kernel, group))
    params, cfg = make_model(kind)
    reference = prepare_params(params, quantize="int4")
    assert set(kernels_used(reference)) == {f"int4 {kernel}/{group}"}
    prompts = [[5, 17, 42, 8], [100, 3, 250, 77, 9, 11]]
    with Engine(params, cfg, None, quantize="int4", page_size=4, max_batch=4) as e:
        outs = e.generate(prompts, max_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(reference, cfg, prompt, 12)


# (ms a row, ms a call) of each product; then the (split, road) chosen with the gemm road and
# without it (a CPU without AVX-512 VNNI): the road fastest at 1,024 rows, and the rows of
# DENSE_ROWS (64, 256, 1,024) before the first at which it beats gemv
ROAD_COSTS = {
    "gemm from 64 rows": (
        {"gemv": (1.0, 0), "dense": (0.4, 20), "gemm": (0.3, 10)}, (16, "gemm"), (16, "dense")
    ),
    "dense from 256 rows": (
        {"gemv": (1.0, 0), "dense": (0.2, 80), "gemm": (0.9, 0)}, (64, "dense"), (64, "dense")
    ),
    "gemv throughout": (
        {"gemv": (0.1, 0), "dense": (0.4, 20), "gemm": (0.3, 10)}, (None, "gemm"), (None, "dense")
    ),
}  # fmt: skip


@pytest.mark.parametrize("isa", [1, 2])
@pytest.mark.parametrize("case", ROAD_COSTS)
def test_prompts_take_the_road_fastest_at_most_rows_from_where_it_beats_gemv(
    case, isa, monkeypatch
):
    skip_unless_here("gemv")
    costs, with_gemm, without = ROAD_COSTS[case]
    monkeypatch.setattr(gemv, "isa", lambda: isa)
    timed = {name: cost for name, cost in costs.items() if isa == 2 or name != "gemm"}

    def timings(runs, measure):
        rows = measure.keywords["x"].shape[0]
        assert set(runs) == set(timed)
        return {name: per_row * rows + fixed for name, (per_row, fixed) in timed.items()}

    monkeypatch.setattr(prepare, "best_of_rounds", timings)
    chosen = prepare._int4_split.__wrapped__(64, 96, "cpu", 32, 1)
    assert chosen == (with_gemm if isa == 2 else without)


def test_no_4_bit_product_here_is_an_error_naming_each_and_why(fresh_choices):
    cfg = ai.ModelConfig(**(BASE | {"hidden_size": 24, "intermediate_size": 48}))
    params = ai.init_params(cfg, seed=0)
    with pytest.raises(ValueError, match=r"no int4 product .*\(weight_only: in_features 24 is"):
        Engine(params, cfg, None, quantize="int4")


def largest_group(kernel: str, road: str | None = None):
    """fastest_int4 held to `kernel` at the largest group size that divides: the coarsest
    4-bit weights it may choose; with a road, every input of more than 0 rows takes it."""

    def chosen(out_features, in_features, *rest):
        group = groups_for(in_features)[-1]
        return (kernel, group) if road is None else (kernel, group, 0, road)

    return chosen


@pytest.mark.parametrize(
    "kernel, road", [(k, None) for k in KERNELS] + [("gemv", r) for r in ROADS]
)
def test_a_trained_model_keeps_its_perplexity_and_greedy_choices_in_4_bits(
    trained,  # noqa: F811
    kernel,
    road,
    monkeypatch,
):
    if road is None:
        skip_unless_here(kernel)
    else:
        skip_unless_road_here(road)
    monkeypatch.setattr(prepare, "fastest_int4", largest_group(kernel, road))
    params, cfg = trained
    held_out = markov_text(32, 33, seed=10_000)
    full = perplexity(params, cfg, held_out)
    assert full < 6  # it learnt the chain (2.6 at best, 64 knowing nothing)
    int4 = prepare_params(params, quantize="int4")
    after = "" if road is None else f" up to 0 rows, then {road}"
    assert set(kernels_used(int4)) <= {f"int4 {kernel}/{g}{after}" for g in GROUPS}
    assert abs(perplexity(int4, cfg, held_out) - full) / full < 0.03
    with torch.inference_mode():
        a = ai.forward(params, cfg, held_out).argmax(-1)
        b = ai.forward(int4, cfg, held_out).argmax(-1)
    assert float((a == b).float().mean()) >= 0.95


def test_our_kernel_picks_the_tokens_torchs_product_picks(trained, monkeypatch):  # noqa: F811
    # the same 4-bit weights; not the same bits out: gemv rounds activations to int8 per block
    # of 32, weight_only to bf16, so a position whose two best logits lie within that rounding
    # may go either way; on the trained chain (one successor at 0.7) that is rare
    skip_unless_here("gemv")
    skip_unless_here("weight_only")
    params, cfg = trained
    held_out = markov_text(32, 33, seed=10_000)
    choices = {}
    for kernel in ("gemv", "weight_only"):
        monkeypatch.setattr(prepare, "fastest_int4", largest_group(kernel))
        with torch.inference_mode():
            prepared = prepare_params(params, quantize="int4")
            choices[kernel] = ai.forward(prepared, cfg, held_out).argmax(-1)
    assert float((choices["gemv"] == choices["weight_only"]).float().mean()) >= 0.99
