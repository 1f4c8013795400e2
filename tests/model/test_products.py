"""Training's float32 products by oneDNN (astrai/model/products.py): the same values and
gradients as torch's, eagerly, under torch.func and compiled, wherever the timing sends them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close

from astrai.model import products

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch was built without oneDNN"
)


@pytest.fixture
def onednn(monkeypatch):
    """Every kind of product by oneDNN, whatever this machine's timing chose."""
    monkeypatch.setattr(products, "ONEDNN", dict.fromkeys(products.KINDS, True))


def operands(rows=40, inputs=48, outputs=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, rows // 2, inputs, generator=g, requires_grad=True)
    w = torch.randn(outputs, inputs, generator=g, requires_grad=True)
    return x, w


def test_onednn_reads_transposed_views_as_they_lie():
    x, w = (t.detach() for t in operands())
    x = x.reshape(-1, x.shape[-1])
    dy = torch.randn(x.shape[0], w.shape[0])
    # each product sums over one dimension of the operands: that many roundings
    assert_close(products.onednn_linear(x, w), x @ w.t(), x.shape[1])
    assert_close(products.onednn_linear(dy, w.t()), dy @ w, w.shape[0])
    assert_close(products.onednn_linear(dy.t(), x.t()), dy.t() @ x, x.shape[0])


def test_gradients_by_onednn_are_torchs(onednn):
    x, w = operands()
    assert products.takes(x, w)
    y = products.linear(x, w)
    assert y.shape == (*x.shape[:-1], w.shape[0])
    dx, dw = torch.autograd.grad(y.square().sum(), (x, w))
    ref_dx, ref_dw = torch.autograd.grad(F.linear(x, w).square().sum(), (x, w))
    rows = x.shape[0] * x.shape[1]
    assert_close(dx, ref_dx, 2 * x.shape[-1] + w.shape[0])
    assert_close(dw, ref_dw, 2 * x.shape[-1] + rows)


def test_under_torch_func_and_compiled(onednn):
    x, w = (t.detach() for t in operands())

    def loss(w, x):
        return products.linear(x, w).square().sum()

    grad = torch.func.grad(loss)(w, x)
    expected = torch.func.grad(lambda w, x: F.linear(x, w).square().sum())(w, x)
    roundings = 2 * x.shape[-1] + x.shape[0] * x.shape[1]
    assert_close(grad, expected, roundings)
    # one graph: inductor calls the op as it is (its own lowering of mkldnn's linear refuses
    # plain weights)
    compiled = torch.compile(loss, fullgraph=True, backend="inductor")
    wc = w.clone().requires_grad_(True)
    compiled(wc, x).backward()
    assert_close(wc.grad, expected, roundings)


def test_only_float32_training_products_take_the_choice(onednn):
    x, w = operands()
    assert products.takes(x, w)
    with torch.no_grad():
        assert not products.takes(x, w)  # inference keeps F.linear (and its prepared weights)
    assert not products.takes(x.detach(), w.detach())
    assert not products.takes(x.bfloat16(), w.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not products.takes(x, w)  # autocast's bf16 products are oneDNN's already


def test_torchs_products_until_chosen(monkeypatch):
    monkeypatch.setattr(products, "ONEDNN", {})
    x, w = operands()
    assert not products.takes(x, w)
    chosen = products.choose(64, 32, 48)
    assert set(chosen) == set(products.KINDS) and chosen is products.ONEDNN
    assert products.choose(4096, 4096, 4096) is chosen  # once a process: no second timing
