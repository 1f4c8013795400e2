"""A float32 prompt's MLP at inference in pieces of rows (astrai/model/layers.py, PIECE_BYTES):
the result of the whole product, and whole where it must be (training, bfloat16, adapters)."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close

from astrai.model import layers

HIDDEN, MLP = 32, 48


def mlp_params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {
        "mlp.gate_up_proj.weight": (torch.randn(2 * MLP, HIDDEN, generator=g) / 6).to(dtype),
        "mlp.down_proj.weight": (torch.randn(HIDDEN, MLP, generator=g) / 7).to(dtype),
    }


@pytest.fixture
def pieces(monkeypatch):
    """The pieces each call of the MLP ran, with a piece of at most 8 rows' gate-up output."""
    monkeypatch.setattr(layers, "PIECE_BYTES", 8 * 2 * MLP * 4)
    ran = []
    real = layers._gated_mlp
    monkeypatch.setattr(
        layers, "_gated_mlp", lambda *a: ran.append(a[2].numel() // HIDDEN) or real(*a)
    )
    return ran


def test_a_float32_prompt_runs_in_pieces_with_the_whole_products_result(pieces, monkeypatch):
    params, x = mlp_params(), torch.randn(3, 7, HIDDEN)  # 21 rows: pieces of 7
    with torch.inference_mode():
        out = layers.gated_mlp(params, "mlp", x)
        monkeypatch.setattr(layers, "PIECE_BYTES", 1 << 40)
        whole = layers.gated_mlp(params, "mlp", x)
    assert pieces == [7, 7, 7, 21]
    assert out.shape == whole.shape == x.shape
    # another row count may take another blocking of the same sums (HIDDEN, then MLP terms)
    assert_close(out, whole, roundings=HIDDEN + MLP)


def test_training_bfloat16_and_adapters_keep_the_prompt_whole(pieces):
    x = torch.randn(21, HIDDEN)
    layers.gated_mlp(mlp_params(), "mlp", x)  # a gradient may be recorded
    with torch.inference_mode():
        layers.gated_mlp(mlp_params(torch.bfloat16), "mlp", x.bfloat16())
        lora = {"scale": 1.0, "weights": {}}
        layers.gated_mlp(mlp_params(), "mlp", x, lora)
        layers.gated_mlp(mlp_params(), "mlp", x[:8])  # one piece's rows
    assert pieces == [21, 21, 21, 8]
