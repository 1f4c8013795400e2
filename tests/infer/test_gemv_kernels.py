"""Our C products (astrai/kernels): each instruction-set path against the float32 product of the
same dequantized weights, within the error the activations' int8 rounding allows; rows 1 to 5 and 13,
one and two threads, widths the layout pads; the float32 and bfloat16 product in float64 within
float32's rounding, at every row count it takes; shapes refused by name; the reason when
absent."""

from __future__ import annotations

import pytest
import torch
from numerics import int8_block_half_steps

from astrai.infer import support
from astrai.infer.float_gemv import GemvMatrix, kernel_rows
from astrai.infer.int4 import dequantize, quantize_groups
from astrai.infer.quant import quantize_rows
from astrai.kernels import build, gemv

FLOAT32_EPS = torch.finfo(torch.float32).eps
ISA = {1: "avx2", 2: "avx512_vnni"}


def paths_here() -> list[int]:
    """The instruction-set paths this CPU runs: AVX2 wherever the kernels run, and AVX-512 VNNI
    where the CPU has it."""
    lib = build.kernel_library()
    return [] if lib is None else list(range(1, lib.astrai_gemv_isa() + 1))


def path(isa: int) -> int:
    if build.kernel_library() is None:
        pytest.skip(f"our C kernels are absent: {build.why_absent()}")
    if isa not in paths_here():
        pytest.skip(f"the CPU has no {ISA[isa]}")
    return isa


def bound(x: torch.Tensor, weights: torch.Tensor, terms: torch.Tensor, block: int) -> torch.Tensor:
    """The worst case of |kernel(x) - x @ weights.T|: each activation within half its block's
    int8 step of x (int8_block_half_steps; a block of `block` inputs), integer sums exact, then
    float32 roundings (a scaling per block and an add per block of 32 and group, and a few more)
    relative to the terms' magnitudes (terms >= |each float32 product the kernel sums|)."""
    activation = int8_block_half_steps(x, block)
    roundings = x.shape[-1] // 32 * 2 + 16
    return activation @ weights.abs().T + roundings * FLOAT32_EPS * (
        (x.abs() + activation) @ terms.T
    )


def int4_case(out_features: int, in_features: int, group: int, product=gemv.int4_product):
    g = torch.Generator().manual_seed(out_features * in_features + group)
    w = torch.randn(out_features, in_features, generator=g)
    q, scale, zero = quantize_groups(w, group)
    packed = gemv.pack_int4(q, scale, zero, group)
    weights = dequantize(q, scale, zero)
    step = scale.repeat_interleave(group, dim=1)
    # the kernel sums q * scale and (zero - 8 * scale) apart: each at most |W| + 15 * scale
    terms = 2 * weights.abs() + 30 * step
    run = product(*packed, group, (out_features, in_features))
    return run, weights, terms, gemv.activation_block(group)


def int8_case(out_features: int, in_features: int):
    g = torch.Generator().manual_seed(out_features * in_features)
    q, scale = quantize_rows(torch.randn(out_features, in_features, generator=g))
    weights = q.float() * scale[:, None]
    # the kernel sums (q + 128) * scale and takes 128 * scale * sum(x) off: each term at most
    # |W| + 128 * scale
    terms = weights.abs() + 128 * scale[:, None]
    return (
        gemv.int8_product(gemv.pack_int8(q), scale, (out_features, in_features)),
        weights,
        terms,
        gemv.BLOCK,
    )


# [out, in]: rows no column block of 16 divides, a width the layout pads (96, 160: not multiples
# of 64)
CASES = [
    ("int4", lambda: int4_case(13, 96, 32)),
    ("int4", lambda: int4_case(40, 256, 64)),
    ("int4", lambda: int4_case(9, 384, 128)),
    ("int4", lambda: int4_case(33, 160, 32)),
    ("int4", lambda: int4_case(70, 128, 64)),  # the two threads' blocks, the last part padding
    ("int4", lambda: int4_case(70, 2176, 128)),  # 17 groups: past the first 16 scale products
    ("int8", lambda: int8_case(13, 96)),
    ("int8", lambda: int8_case(37, 256)),
    ("int8", lambda: int8_case(5, 45)),  # a width no block divides: padded
    ("int8", lambda: int8_case(61, 128)),  # the two threads' blocks, the last part padding
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("isa", list(ISA))
@pytest.mark.parametrize("threads", [1, 2])
def test_each_path_is_within_the_int8_activation_rounding(case, isa, threads):
    path(isa)
    run, weights, terms, block = CASES[case][1]()
    g = torch.Generator().manual_seed(case)
    for rows in (1, 2, 3, 4, 5, 13):  # 13: AVX-512 eight rows a pass, then five; AVX2 threes
        x = torch.randn(rows, weights.shape[1], generator=g)
        y = run(x, threads=threads, isa=isa)
        assert y.shape == (rows, weights.shape[0]) and y.dtype == torch.float32
        assert bool(((y - x @ weights.T).abs() <= bound(x, weights, terms, block)).all()), rows


@pytest.mark.parametrize("case", range(len(CASES)))
def test_rows_threads_and_paths_do_not_change_a_row(case):
    # each output is summed in the same order whatever the rows beside it or the thread that
    # computes it: the same bits
    path(1)
    run, weights, *_ = CASES[case][1]()
    x = torch.randn(13, weights.shape[1], generator=torch.Generator().manual_seed(1))
    for isa in paths_here():
        alone = torch.cat([run(row[None], threads=1, isa=isa) for row in x])
        assert torch.equal(run(x, threads=2, isa=isa), alone)


# [out, in, group]: a last panel of 32 columns part padding, and one past the column blocks
GEMM_CASES = [(13, 96, 32), (40, 256, 64), (9, 384, 128), (33, 160, 32), (70, 2176, 128)]


@pytest.mark.parametrize("shape", GEMM_CASES)
def test_the_many_row_product_is_within_the_rounding_and_a_row_alone_is_the_same(shape):
    # gemm.c: blocks of six rows, then the rest in one; a row's sums are its own, and the
    # threads split the columns, so a row's outputs are the same bits alone, in any batch,
    # and as gemv's
    path(2)
    run, weights, terms, block = int4_case(*shape, product=gemv.int4_gemm_product)
    x = torch.randn(40, weights.shape[1], generator=torch.Generator().manual_seed(2))
    for rows in (1, 5, 6, 7, 13, 40):
        y = run(x[:rows], threads=2)
        assert y.shape == (rows, weights.shape[0]) and y.dtype == torch.float32
        assert bool(
            ((y - x[:rows] @ weights.T).abs() <= bound(x[:rows], weights, terms, block)).all()
        )
    alone = torch.cat([run(row[None], threads=1) for row in x])
    assert torch.equal(run(x, threads=2), alone)
    # gemv.c sums the same integers and floats in the same order: the same bits on either road
    assert torch.equal(int4_case(*shape)[0](x, isa=2), alone)


def test_the_many_row_product_refuses_the_avx2_path():
    path(1)
    run, *_ = int4_case(8, 64, 32, product=gemv.int4_gemm_product)
    with pytest.raises(RuntimeError, match="int4 gemm kernel refused the call: an instruction"):
        run(torch.randn(3, 64), isa=1)


FLOAT_ISA = {1: "avx2", 2: "avx512", 3: "avx512_bf16", 4: "amx_bf16"}


def float_path(isa: int) -> int:
    """The float product's path `isa` where this CPU runs it (3, the bfloat16 dot products, for
    bfloat16 weights; float32 ones take path 2 there)."""
    path(1)
    if isa > gemv.float_isa():
        pytest.skip(f"the CPU has no {FLOAT_ISA[isa]}")
    return isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", list(FLOAT_ISA))
@pytest.mark.parametrize("shape", [(13, 96), (4, 16), (37, 256), (1, 48), (150, 64)])
def test_the_float_product_sums_in_float32_at_any_row_count(dtype, isa, shape):
    float_path(isa)
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=g).to(dtype)
    run = gemv.float_product(w)
    exact = w.double()
    for rows in (1, 2, 3, 4, 5, 9, 16):
        # a bfloat16 model's activations are bfloat16 values (the dot path rounds them to it)
        x = torch.randn(rows, shape[1], generator=g).to(dtype).float()
        for threads in (1, 2):
            y = run(x, threads=threads, isa=isa)
            assert y.shape == (rows, shape[0]) and y.dtype == torch.float32
            # float32 products and sums of `in` terms: at most `in` roundings of their magnitude
            limit = shape[1] * FLOAT32_EPS * (x.double().abs() @ exact.abs().T)
            assert bool(((y.double() - x.double() @ exact.T).abs() <= limit).all()), rows
        assert torch.equal(run(x, threads=1, isa=isa)[:1], run(x[:1], threads=2, isa=isa))


def _random_product(kind: int, generator: torch.Generator):
    """(run, the paths it has here) of a random 150 x 256 matrix of `kind` on our kernel."""
    if kind == gemv.INT8:
        return int8_case(150, 256)[0], gemv.isa()
    if kind == gemv.INT4:
        return int4_case(150, 256, 128)[0], gemv.isa()
    dtype = torch.float32 if kind == gemv.FLOAT32 else torch.bfloat16
    return gemv.float_product(
        torch.randn(150, 256, generator=generator).to(dtype)
    ), gemv.float_isa()


@pytest.mark.parametrize("kind", [gemv.FLOAT32, gemv.BFLOAT16, gemv.INT8, gemv.INT4])
def test_asking_for_the_weights_ahead_at_one_row_changes_no_value(kind):
    from astrai.infer.ahead import one_row_ahead

    path(1)
    if kind in (gemv.FLOAT32, gemv.BFLOAT16):
        one_row_ahead(kind)  # timed first, from the kernels' own way
    own = gemv.one_row_ahead(kind)
    g = torch.Generator().manual_seed(5)
    run, paths = _random_product(kind, g)
    x = torch.randn(1, 256, generator=g).bfloat16().float()
    try:
        for isa in range(1, paths + 1):
            ys = []
            for ahead in (True, False):
                gemv.one_row_ahead(kind, ahead)
                ys.append(run(x, isa=isa))
            assert torch.equal(*ys), isa
    finally:
        gemv.one_row_ahead(kind, own)  # as this process had it


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("faster", [True, False])
@pytest.mark.parametrize("slower", [2.0, 1.02])
def test_one_row_asks_ahead_where_that_is_faster_by_the_margin(monkeypatch, own, faster, slower):
    # the way timed `slower` times the other's is left where that is past the margin, and the
    # kernels' own way is kept where it is within it
    from astrai.infer import ahead

    path(1)
    state = [own]

    def setting(kind, on=None):
        if on is not None:
            state.append(on)
        return state[-1]

    monkeypatch.setattr(gemv, "one_row_ahead", setting)
    monkeypatch.setattr(ahead, "pass_seconds", lambda runs, x: slower if state[-1] != faster else 1)
    chosen = ahead.one_row_ahead.__wrapped__(gemv.FLOAT32)
    assert chosen is (faster if slower > ahead.MARGIN else own)
    assert state[-1] is chosen  # and the kernels are left that way


def test_the_float_product_refuses_what_it_cannot_take():
    path(1)
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16"):
        gemv.float_product(torch.randn(4, 32).double())
    with pytest.raises(RuntimeError, match="a shape it does not take"):
        gemv.float_product(torch.randn(4, 24))(torch.randn(1, 24))  # not a multiple of 16
    with pytest.raises(ValueError, match="x has 16 features, the float matrix takes 32"):
        gemv.float_product(torch.randn(4, 32))(torch.randn(1, 16))


def test_a_scale_off_by_ten_percent_is_outside_the_bound():
    # the bound is tight enough to catch a wrongly scaled product (positive values: no cancel)
    path(1)
    g = torch.Generator().manual_seed(0)
    w, x = torch.rand(40, 256, generator=g), torch.rand(3, 256, generator=g)
    q, scale, zero = quantize_groups(w, 32)
    weights = dequantize(q, scale, zero)
    terms = 2 * weights + 30 * scale.repeat_interleave(32, dim=1)
    wrong = gemv.int4_product(*gemv.pack_int4(q, scale * 1.1, zero, 32), 32, (40, 256))
    error = (wrong(x) - x @ weights.T).abs()
    assert bool((error > bound(x, weights, terms, gemv.activation_block(32))).any())


def test_groups_and_inputs_it_cannot_take_are_refused_by_name():
    with pytest.raises(ValueError, match="group 128 does not divide the padded width 192"):
        gemv.pack_int4(torch.zeros(4, 192, dtype=torch.uint8), None, None, 128)
    q, scale, zero = quantize_groups(torch.randn(4, 96), 32)
    path(1)
    run = gemv.int4_product(*gemv.pack_int4(q, scale, zero, 32), 32, (4, 96))
    with pytest.raises(ValueError, match="x has 64 features, the int4 matrix takes 96"):
        run(torch.randn(1, 64))


def test_without_a_compiler_the_kernels_are_absent_and_refused_with_the_reason(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "")
    assert build.compiler() is None
    lib, reason = build._load.__wrapped__()
    assert lib is None and "no C compiler" in reason
    monkeypatch.setattr(support, "why_absent", lambda: reason)
    for dtype in (torch.int8, torch.int4):
        support._probe.cache_clear()
        assert products_reason(dtype) == reason
    support._probe.cache_clear()


def products_reason(dtype) -> str | None:
    return support.products_here(dtype, (16, 64))["gemv"]


def test_a_gemv_matrix_hands_prompts_and_gradients_to_torch():
    path(1)
    w, calls = torch.randn(8, 32), []
    kernel = gemv.float_product(w)
    matrix = GemvMatrix(w, lambda x: calls.append(len(x)) or kernel(x))
    most = kernel_rows(torch.float32)
    for rows in (1, most, most + 1):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(matrix.linear(x), x @ w.T)
    assert calls == [1, most]  # a longer input went to torch's product
    x = torch.randn(2, 32, requires_grad=True)
    matrix.linear(x).sum().backward()  # the kernel has no gradient: torch's product ran
    assert calls == [1, most] and x.grad is not None


@pytest.mark.parametrize("kernel_works", [0, 2])
def test_the_rows_the_kernel_takes_are_those_it_leads_at(monkeypatch, kernel_works):
    # a kernel slower than the prompt's product at 16 rows (here: that product twice) hands
    # them to it; one faster (no work at all) keeps them
    path(1)
    from astrai.infer import float_gemv

    def product(w):
        return lambda x: [torch.nn.functional.linear(x, w) for _ in range(kernel_works)]

    monkeypatch.setattr(gemv, "float_product", product)
    monkeypatch.setattr(float_gemv, "prompt_product", lambda dtype: torch.nn.functional.linear)
    leads = float_gemv._kernel_leads_at(16, torch.bfloat16, shape=(2048, 1024))
    assert leads == (kernel_works == 0)


@pytest.mark.parametrize("onednn_works", [0, 2])
def test_a_prompt_goes_to_the_faster_of_torchs_and_onednns_products(monkeypatch, onednn_works):
    # oneDNN's product made slower than F.linear (here: F.linear twice) is not taken; one
    # faster (no work at all) is
    from astrai.infer import float_gemv

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch was built without oneDNN")

    def onednn(x, weight):
        return [torch.nn.functional.linear(x, weight) for _ in range(onednn_works)]

    monkeypatch.setattr(float_gemv, "mkldnn_linear", onednn)
    chosen = float_gemv.prompt_product.__wrapped__(torch.float32)
    assert chosen is (onednn if onednn_works == 0 else torch.nn.functional.linear)
