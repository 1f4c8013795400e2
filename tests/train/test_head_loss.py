"""The chunked head + cross-entropy against F.linear and F.cross_entropy written plainly: the
same loss and the same gradients, in float32 and under bf16 autocast, through torch.autograd
and torch.func; with torch's ops (a vocabulary of 100) and with our C kernel (104, a multiple
of 8)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import tolerance

from astrai.config import ModelConfig
from astrai.kernels.build import why_absent
from astrai.kernels.cross_entropy import cross_entropy_grad_
from astrai.model import IGNORE, products
from astrai.train import head_loss
from astrai.train.head_loss import fused_head_applies, head_cross_entropy_sum

B, T, H, V = 2, 7, 16, 100
KERNEL_V = 104  # our C kernel takes vocabularies of a multiple of 8
SCALE = 0.7  # what the step multiplies the summed loss by (its weight over its count)


needs_kernels = pytest.mark.skipif(why_absent() is not None, reason=f"{why_absent()}")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 3 rows: 14 rows take five chunks, the last one short."""
    monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", 3 * V)
    monkeypatch.setattr(head_loss, "KERNEL_CHUNK_ELEMENTS", 3 * KERNEL_V)


@pytest.fixture(params=["torch", "onednn"])
def library(request, monkeypatch):
    """The float32 products by torch's library or by oneDNN's (astrai/model/products.py),
    whichever this machine's timing would choose."""
    onednn = request.param == "onednn"
    if onednn and not torch.backends.mkldnn.is_available():
        pytest.skip("torch was built without oneDNN")
    monkeypatch.setattr(products, "ONEDNN", dict.fromkeys(products.KINDS, onednn))


def _inputs(seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(vocab, H, generator=g) * 0.5
    labels = torch.randint(0, vocab, (B, T), generator=g)
    labels[0, -1] = labels[1, 2] = IGNORE
    return hidden, weight, labels


def _plain(hidden, weight, labels, smoothing):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(
        logits.flatten(0, 1),
        labels.flatten(),
        ignore_index=IGNORE,
        label_smoothing=smoothing,
        reduction="sum",
    )


def _loss_and_grads(loss_of, hidden, weight, labels, smoothing, bf16):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = loss_of(hidden, weight, labels, smoothing)
    (loss * SCALE).backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("vocab", [V, KERNEL_V])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bf16", [False, True])
def test_the_same_loss_and_gradients_as_the_plain_head_and_cross_entropy(
    smoothing, bf16, vocab, library
):
    hidden, weight, labels = _inputs(vocab=vocab)
    fused = _loss_and_grads(head_cross_entropy_sum, hidden, weight, labels, smoothing, bf16)
    plain = _loss_and_grads(_plain, hidden, weight, labels, smoothing, bf16)
    assert fused[1].dtype == fused[2].dtype == torch.float32  # grads in the params' dtype
    if bf16:
        # Both round the logits and their gradient to bf16 and the products' outputs again
        # (a product split into chunks may round a logit the other way: one more), and the
        # step's factor is applied before the rounding on one side, after it on the other.
        roundings, dtype = 5, torch.bfloat16
    else:
        # The log-sum-exp over V words per row, the sum over B * T rows, and each gradient a
        # product over V words (hidden) or the rows (weight).
        roundings, dtype = vocab + B * T + H, torch.float32
    for a, b in zip(fused, plain, strict=True):
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a, b, **tolerance(roundings, dtype, scale))


@pytest.mark.parametrize("vocab", [V, KERNEL_V])
def test_torch_func_takes_the_same_gradients_as_autograd(vocab, library):
    hidden, weight, labels = _inputs(1, vocab)
    _, hidden_grad, weight_grad = _loss_and_grads(
        head_cross_entropy_sum, hidden, weight, labels, 0.1, False
    )
    grads = torch.func.grad(
        lambda h, w: head_cross_entropy_sum(h, w, labels, 0.1) * SCALE, argnums=(0, 1)
    )(hidden, weight)
    # the same kernels on the same inputs: the same numbers
    assert torch.equal(grads[0], hidden_grad) and torch.equal(grads[1], weight_grad)


@pytest.mark.parametrize("vocab", [V, KERNEL_V])
def test_ignored_positions_add_nothing_and_take_no_gradient(vocab):
    hidden, weight, labels = _inputs(2, vocab)
    labels[1] = IGNORE
    h = hidden.clone().requires_grad_()
    head_cross_entropy_sum(h, weight, labels).backward()
    assert torch.count_nonzero(h.grad[1]) == 0 and torch.count_nonzero(h.grad[0]) > 0
    only_first = head_cross_entropy_sum(hidden[:1], weight, labels[:1])
    # the same terms, summed in chunks of other sizes
    torch.testing.assert_close(
        head_cross_entropy_sum(hidden, weight, labels), only_first, **tolerance(B * T + vocab)
    )


@needs_kernels
def test_the_kernel_runs_where_it_takes_the_logits(monkeypatch):
    calls = []
    monkeypatch.setattr(
        head_loss, "cross_entropy_grad_", lambda *a: calls.append(a) or cross_entropy_grad_(*a)
    )
    for vocab in (V, KERNEL_V):
        head_cross_entropy_sum(*_inputs(vocab=vocab))
    assert len(calls) == 5  # the five chunks of the vocabulary of 104, none of 100's


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_matches_float64_on_a_large_vocabulary(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 32000, generator=g) * 4).to(dtype)
    labels = torch.tensor([7, IGNORE, 31999, 0, 12345])
    exact = logits.double().requires_grad_()
    loss = F.cross_entropy(exact, labels, ignore_index=IGNORE, label_smoothing=0.1, reduction="sum")
    loss.backward()
    grad = logits.clone()
    got = cross_entropy_grad_(grad, labels, IGNORE, 0.1)
    # each row's log-sum-exp and mean over 32,000 words in float32, then the rows' sum
    torch.testing.assert_close(got.double(), loss.detach(), **tolerance(32000, torch.float32))
    # the softmax's normaliser is a float32 sum of 32,000 terms; bfloat16 rounds once more at
    # the end; gradients are about 1 / 32,000 (the floor smoothing subtracts is 0.1 of that)
    roundings = 32000 if dtype == torch.float32 else 2
    expected = exact.grad.to(dtype)
    torch.testing.assert_close(grad, expected, **tolerance(roundings, dtype, scale=1 / 32000))
    assert torch.count_nonzero(grad[1]) == 0


@needs_kernels
def test_the_kernel_says_nan_and_refuses_a_label_outside_the_vocabulary():
    logits = torch.zeros(2, 16)
    logits[1, 3] = float("nan")
    assert cross_entropy_grad_(logits, torch.tensor([1, 2]), IGNORE, 0.0).isnan()
    with pytest.raises(ValueError, match=r"outside \[0, 16\)"):
        cross_entropy_grad_(torch.zeros(2, 16), torch.tensor([1, 16]), IGNORE, 0.0)
    assert cross_entropy_grad_(torch.zeros(2, 12), torch.tensor([1, 2]), IGNORE, 0.0) is None


def test_bad_input_is_refused_with_the_field_named():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="labels"):
        head_cross_entropy_sum(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="label_smoothing"):
        head_cross_entropy_sum(hidden, weight, labels, label_smoothing=1.5)
    with pytest.raises(ValueError, match="head weight"):
        head_cross_entropy_sum(hidden, weight.double(), labels)


def test_heads_that_change_the_logits_keep_the_plain_path():
    base = dict(vocab_size=V, hidden_size=H, num_hidden_layers=1, num_attention_heads=2)
    weight = torch.zeros(V, H)
    assert fused_head_applies(ModelConfig(**base), weight)
    assert not fused_head_applies(ModelConfig(**base, final_logit_softcapping=30.0), weight)
    assert not fused_head_applies(ModelConfig(**base, logits_scaling=2.0), weight)


@pytest.mark.parametrize("vocab", [V, KERNEL_V])
def test_a_gradient_buffer_is_reused_only_once_its_graph_is_freed(vocab):
    hidden, weight, labels = _inputs(4, vocab)
    other = hidden.flip(0)  # other rows of the same shape: a second call's own gradients
    expected = [
        _loss_and_grads(head_cross_entropy_sum, x, weight, labels, 0.0, False)[1]
        for x in (hidden, other)
    ]
    h1, h2 = hidden.clone().requires_grad_(), other.clone().requires_grad_()
    first = head_cross_entropy_sum(h1, weight, labels)
    second = head_cross_entropy_sum(h2, weight, labels)  # the first graph still holds its buffer
    (first * SCALE).backward(retain_graph=True)
    (second * SCALE).backward()
    third = head_cross_entropy_sum(other.clone().requires_grad_(), weight, labels)
    (first * SCALE).backward()  # the retained graph reads its buffer again, after a new call
    assert torch.equal(h1.grad, 2 * expected[0]) and torch.equal(h2.grad, expected[1])
    third.backward()
    buffer = head_loss._SPARE[0].data_ptr()
    head_cross_entropy_sum(h1, weight, labels).backward()  # all graphs freed: the same buffer
    assert head_loss._SPARE[0].data_ptr() == buffer


def test_a_buffer_made_in_inference_mode_is_not_reused_for_training():
    hidden, weight, labels = _inputs(5, KERNEL_V)
    with torch.inference_mode():  # an evaluation's loss
        evaluated = head_cross_entropy_sum(hidden, weight, labels)
    h = hidden.clone().requires_grad_()
    trained = head_cross_entropy_sum(h, weight, labels)
    trained.backward()
    assert torch.equal(trained.detach(), evaluated) and h.grad is not None
    with torch.inference_mode():  # and a training buffer is not taken for an evaluation
        assert torch.equal(head_cross_entropy_sum(hidden, weight, labels), evaluated)
