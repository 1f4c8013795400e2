"""Training's float32 products on the CPU, x @ W.T and its two gradients, by torch's library
(MKL) or oneDNN's, whichever multiplies faster on the running machine.

MKL runs its AVX-512 code on Intel processors only: on a 2-core AMD EPYC Zen 5, 1024 x 1024
float32 products ran at ~225 GFLOP/s through torch's `mm` and ~500 through oneDNN's linear
(torch.ops.mkldnn, the library torch already multiplies bfloat16 with), and an eager float32
step of the benchmark's small model took 1.57-1.64 s against 2.55. Each of a weight's three
products (the forward, the input's gradient dY @ W, the weight's dY.T @ x) is timed once a
process on both libraries at the model's own shapes (`choose`), and takes oneDNN only where
it is MARGIN faster: on a near tie (an Intel CPU, a CPU held to AVX2) torch's roundings stay.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from astrai.timing import best_of_rounds

KINDS = ("forward", "input", "weight")
MARGIN = 1.1
ONEDNN: dict[str, bool] = {}  # kind -> whether oneDNN multiplies it, once chosen
ROWS = 4096  # the most rows the timing multiplies: enough to show each library's speed


def mkldnn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, K] @ weight.T by oneDNN: weight [M, K] in any strides (a transposed view is read as
    it lies), or packed by oneDNN (astrai/infer/packed.py)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@torch.library.custom_op("astrai::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """mkldnn_linear as an op of our own, for torch.compile to call as it is: inductor lowers
    mkldnn's linear for packed weights only. (Eagerly mkldnn_linear itself is called: a custom
    op has no autograd torch.func can transform.)"""
    return mkldnn_linear(x, w)


@onednn_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def by_onednn(kind: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether oneDNN multiplies a @ b.T, a product of this kind: float32 on the CPU where it
    won the timing (torch's for any other dtype, and until `choose` has run)."""
    return ONEDNN.get(kind, False) and a.dtype == b.dtype == torch.float32 and a.is_cpu


def product_t(a: torch.Tensor, b: torch.Tensor, kind: str) -> torch.Tensor:
    """a @ b.T (both 2-D) by the library chosen for its kind of product (KINDS)."""
    if not by_onednn(kind, a, b):
        return a @ b.t()
    return onednn_linear(a, b) if torch.compiler.is_compiling() else mkldnn_linear(a, b)


class _Linear(torch.autograd.Function):
    """x [N, K] @ w.T with each gradient's product by its chosen library."""

    @staticmethod
    def forward(x, w):
        return product_t(x, w, "forward")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = product_t(dy, w.t(), "input") if ctx.needs_input_grad[0] else None
        dw = product_t(dy.t(), x.t(), "weight") if ctx.needs_input_grad[1] else None
        return dx, dw


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w.T, differentiable, by the chosen libraries."""
    y = _Linear.apply(x.reshape(-1, x.shape[-1]), w)
    return y.view(*x.shape[:-1], w.shape[0])


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x @ w.T is a float32 CPU product a gradient will be taken through, and oneDNN
    won some product here (else F.linear, as ever)."""
    return (
        any(ONEDNN.values())
        and x.dtype == w.dtype == torch.float32
        and x.device.type == "cpu"
        and torch.is_grad_enabled()
        and (x.requires_grad or w.requires_grad)
        and not torch.is_autocast_enabled("cpu")
    )


def choose(rows: int, inputs: int, outputs: int) -> dict[str, bool]:
    """Time each kind of product on both libraries at [rows, inputs] x [outputs, inputs]
    (rows up to ROWS), once a process: the first training step's shapes decide. Returns ONEDNN."""
    if ONEDNN or not torch.backends.mkldnn.is_available():
        return ONEDNN
    g = torch.Generator().manual_seed(0)
    rows = max(1, min(rows, ROWS))
    x, dy = torch.randn(rows, inputs, generator=g), torch.randn(rows, outputs, generator=g)
    w = torch.randn(outputs, inputs, generator=g)
    operands = {"forward": (x, w), "input": (dy, w.t()), "weight": (dy.t(), x.t())}
    for kind, (a, b) in operands.items():
        libraries = {"torch": lambda a=a, b=b: a @ b.t(), "onednn": partial(mkldnn_linear, a, b)}
        best = best_of_rounds(libraries, _seconds)
        ONEDNN[kind] = best["torch"] > MARGIN * best["onednn"]
    return ONEDNN


def _seconds(product) -> float:
    start = time.perf_counter()
    product()
    return time.perf_counter() - start
