"""The panel layout (astrai/infer/panels.py, astrai/kernels/panels.c): the product of float32 and
bfloat16 weights in float64 within float32's rounding at every row count, whole and partial
panels, one and two threads; a row's outputs the same bits whatever rows share the call; shapes
refused by name; the layout's reason where this CPU lacks its instructions."""

from __future__ import annotations

import pytest
import torch

from astrai.infer import panels
from astrai.infer.float_gemv import prompt_product
from astrai.infer.panels import PanelMatrix, panel_layout, panel_matrix, unpacked
from astrai.infer.support import products_here
from astrai.kernels import gemv

FLOAT32_EPS = torch.finfo(torch.float32).eps


def skip_unless_here(dtype: torch.dtype) -> None:
    if reason := products_here(dtype, (16, 64))["panels"]:
        pytest.skip(f"the panels layout of {dtype}: {reason}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(13, 96), (16, 16), (37, 256), (1, 48), (150, 64)])
def test_the_panel_product_sums_in_float32_at_any_row_count(dtype, shape):
    skip_unless_here(dtype)
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=g).to(dtype)
    run, exact = panel_matrix(w).run, w.double()
    for rows in (1, 2, 5, 16, 17, 33, 40):
        # a bfloat16 model's activations are bfloat16 values (the kernel rounds them to it)
        x = torch.randn(rows, shape[1], generator=g).to(dtype).float()
        for threads in (1, 2):
            y = run(x, threads=threads)
            assert y.shape == (rows, shape[0]) and y.dtype == torch.float32
            # float32 products and sums of `in` terms: at most `in` roundings of their magnitude
            limit = shape[1] * FLOAT32_EPS * (x.double().abs() @ exact.abs().T)
            assert bool(((y.double() - x.double() @ exact.T).abs() <= limit).all()), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(dtype):
    skip_unless_here(dtype)
    g = torch.Generator().manual_seed(1)
    run = panel_matrix(torch.randn(40, 128, generator=g).to(dtype)).run
    x = torch.randn(37, 128, generator=g)
    alone = torch.cat([run(x[r : r + 1], threads=1) for r in range(37)])
    for rows in (2, 16, 17, 37):
        assert torch.equal(run(x[:rows], threads=2), alone[:rows]), rows


def test_bfloat16_activations_are_rounded_to_bfloat16_as_a_bfloat16_model_holds_them():
    skip_unless_here(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=g)
    run = panel_matrix(w).run
    assert torch.equal(run(x), run(x.to(torch.bfloat16).float()))


def test_bfloat16_inputs_give_bfloat16_outputs_with_the_float32_outputs_rounded_once():
    skip_unless_here(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    run = panel_matrix(torch.randn(40, 96, generator=g).to(torch.bfloat16)).run
    for rows in (1, 17, 40):
        x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        y = run(x)
        assert y.dtype == torch.bfloat16 and torch.equal(y, run(x.float()).to(torch.bfloat16))


def test_the_layout_holds_sixteen_outputs_a_panel_and_bfloat16_inputs_in_pairs():
    w = torch.arange(20 * 4, dtype=torch.float32).view(20, 4)
    panels = panel_layout(w)
    assert panels.shape == (2, 4, 16)
    assert torch.equal(panels[0, 1], w[:16, 1]) and torch.equal(panels[1, 2, :4], w[16:, 2])
    assert not panels[1, :, 4:].any()  # the last panel's padding rows
    pairs = panel_layout(w.to(torch.bfloat16))
    assert pairs.shape == (2, 2, 16, 2)
    assert torch.equal(pairs[0, 1, 3], w[3, 2:4].to(torch.bfloat16))


def test_a_panel_matrix_multiplies_in_the_inputs_dtype():
    skip_unless_here(torch.bfloat16)
    w = torch.randn(24, 32).to(torch.bfloat16)
    m = panel_matrix(w)
    assert isinstance(m, PanelMatrix) and m.shape == (24, 32) and m.kernel == "panels"
    x = torch.randn(2, 3, 32).to(torch.bfloat16)
    y = m.linear(x)
    assert y.shape == (2, 3, 24) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_rows_go_to_the_prompts_product_on_the_weights_unpacked(dtype, monkeypatch):
    skip_unless_here(dtype)
    w = torch.randn(37, 64).to(dtype)
    assert torch.equal(unpacked(panel_layout(w), w.shape), w)
    monkeypatch.setattr(panels, "PROMPT_ROWS", 4)
    m, x = panel_matrix(w), torch.randn(2, 3, 64).to(dtype)
    road = panels.prompt_road(dtype)
    if road is None:  # no torch product of dtype here: the kernel takes the prompt
        assert torch.equal(m.linear(x), m.run(x).to(dtype))
        pytest.skip(f"no torch product of {dtype} here")
    assert road is prompt_product(dtype)
    assert torch.equal(m.linear(x), road(x, w))
    assert torch.equal(m.linear(x[0, :2]), m.run(x[0, :2]).to(dtype))  # four rows or fewer


def test_what_it_cannot_take_is_refused_by_name():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        panel_matrix(torch.zeros(16, 32, dtype=torch.float16))
    assert "multiple of 16" in products_here(torch.float32, (16, 40))["panels"]
    skip_unless_here(torch.float32)
    with pytest.raises(ValueError, match="takes 32"):
        panel_matrix(torch.zeros(16, 32)).run(torch.zeros(1, 48))
    run = gemv.panel_product(panel_layout(torch.zeros(16, 40)), (16, 40))
    with pytest.raises(RuntimeError, match="a shape it does not take"):
        run(torch.zeros(1, 40))
