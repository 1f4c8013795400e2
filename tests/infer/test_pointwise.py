"""RMSNorm and gated activations in one C call (astrai/kernels/pointwise.c) against torch's ops:
float32 within its rounding, bfloat16 rounded where torch's ops round; rows of a fused product
read where they lie; refused where a gradient is recorded, where the width or the strides do not
fit; and the layers take them in inference and not in training."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close

from astrai.kernels import build, gemv, pointwise
from astrai.model import layers

pytestmark = pytest.mark.skipif(
    build.kernel_library() is None, reason=f"our C kernels are absent: {build.why_absent()}"
)
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def torch_norm(x, w):
    """astrai.model.layers.rms_norm's torch path (what the kernel replaces)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, EPS)
    return w * F.rms_norm(x.float(), w.shape, eps=EPS).to(x.dtype)


def check(actual, expected, roundings):
    """float32: within `roundings` roundings; bfloat16: within its two roundings (the float32
    steps before them may leave a value on the other side of a rounding boundary)."""
    assert actual.dtype == expected.dtype
    assert_close(actual, expected, 2 if expected.dtype == torch.bfloat16 else roundings)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 896), (3, 5, 64), (7, 8)])
def test_rms_norm_matches_torch(dtype, shape):
    x = randn(*shape, dtype=dtype, seed=1, scale=3.0)
    w = randn(shape[-1], dtype=dtype, seed=2) * 0.1 + 1
    with torch.no_grad():
        out = pointwise.rms_norm(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    check(out, torch_norm(x, w), roundings=4 * shape[-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_the_residual_first(dtype):
    x, y = randn(2, 3, 128, dtype=dtype, seed=3), randn(2, 3, 128, dtype=dtype, seed=4)
    w = randn(128, dtype=dtype, seed=5)
    with torch.no_grad():
        total, out = pointwise.rms_norm(x, w, EPS, residual=y)
    assert torch.equal(total, x + y)  # one addition, rounded once either way
    check(out, torch_norm(x + y, w), roundings=4 * 128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation_reads_the_halves_of_a_fused_product(dtype, act):
    fused = randn(3, 2, 2 * 200, dtype=dtype, seed=6, scale=4.0)
    gate, up = fused.chunk(2, dim=-1)  # strided views: the kernel reads them in place
    with torch.no_grad():
        out = pointwise.gated_activation(act, gate, up)
    check(out, layers.ACTIVATIONS[act](gate) * up, roundings=64)


HELD_TO_AVX2 = """
import sys, torch
from astrai.kernels import pointwise
fused = torch.load(sys.argv[1])
gate, up = fused.chunk(2, dim=-1)
with torch.no_grad():
    torch.save({act: pointwise.gated_activation(act, gate, up) for act in ACTS}, sys.argv[2])
"""


@pytest.mark.skipif(gemv.isa() != 2, reason="the 16-lane row is AVX-512's")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_16_lane_row_gives_the_8_lane_rows_bits(dtype, tmp_path):
    # each lane takes the same steps in both, so a machine's two paths agree to the bit; 200
    # values a row: twelve times 16, then 8 by the 8-lane row
    acts = list(pointwise.ACT_CODES)
    fused = randn(5, 2 * 200, dtype=dtype, seed=8, scale=6.0)
    torch.save(fused, tmp_path / "in.pt")
    code = f"ACTS = {acts!r}" + HELD_TO_AVX2
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    args = [sys.executable, "-c", code, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")]
    subprocess.run(args, env=env, check=True)
    held = torch.load(tmp_path / "out.pt")
    gate, up = fused.chunk(2, dim=-1)
    with torch.no_grad():
        for act in acts:
            assert torch.equal(pointwise.gated_activation(act, gate, up), held[act]), act


def test_extremes_stay_finite_and_nan_stays_nan():
    g = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4, float("nan")])
    with torch.no_grad():
        out = pointwise.gated_activation("silu", g, torch.ones(8))
    assert_close(out[:-1], F.silu(g[:-1]), roundings=16)
    assert out[-1].isnan()


def test_the_kernels_step_aside_where_they_cannot_run():
    x, w = torch.randn(2, 12), torch.randn(12)
    with torch.no_grad():
        assert pointwise.rms_norm(x, w, EPS) is None  # a width not a multiple of 8
        x, w = torch.randn(2, 16), torch.randn(16)
        assert pointwise.rms_norm(x.double(), w.double(), EPS) is None
        assert pointwise.rms_norm(x, w.bfloat16(), EPS) is None  # mixed dtypes
        assert pointwise.rms_norm(torch.randn(16, 2).t(), w, EPS) is None  # columns
        assert pointwise.rms_norm(x, torch.randn(8), EPS) is None  # a weight of another width
        assert pointwise.gated_activation("relu", x, x) is None
        strided = torch.randn(4, 3, 16)[:, ::2]  # rows unevenly spaced
        assert pointwise.rms_norm(strided, w, EPS) is None
    x.requires_grad_(True)
    assert pointwise.rms_norm(x, w, EPS) is None  # a gradient is recorded: torch's ops


def test_the_layers_train_through_torch_and_infer_through_the_kernel(monkeypatch):
    calls = []
    real = pointwise._takes
    monkeypatch.setattr(pointwise, "_takes", lambda *t: calls.append(1) or real(*t))
    x, w = torch.randn(2, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    layers.rms_norm(x, w, EPS).sum().backward()  # the gradient flows: torch's ops ran
    assert x.grad is not None and w.grad is not None
    with torch.no_grad():
        inferred = layers.rms_norm(x, w, EPS)
    assert_close(inferred, F.rms_norm(x, w.shape, w, EPS).detach(), roundings=4 * 64)
    assert calls  # asked each time, taken in inference only
