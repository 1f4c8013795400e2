"""The chunked head + cross-entropy against F.linear and F.cross_entropy written plainly: the
same loss and the same gradients, in float32 and under bf16 autocast, through torch.autograd
and torch.func."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import tolerance

from astrai.config import ModelConfig
from astrai.model import IGNORE
from astrai.train import head_loss
from astrai.train.head_loss import fused_head_applies, head_cross_entropy_sum

B, T, H, V = 2, 7, 16, 100
SCALE = 0.7  # what the step multiplies the summed loss by (its weight over its count)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 3 rows: 14 rows take five chunks, the last one short."""
    monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", 3 * V)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (B, T), generator=g)
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


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bf16", [False, True])
def test_the_same_loss_and_gradients_as_the_plain_head_and_cross_entropy(smoothing, bf16):
    hidden, weight, labels = _inputs()
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
        roundings, dtype = V + B * T + H, torch.float32
    for a, b in zip(fused, plain, strict=True):
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a, b, **tolerance(roundings, dtype, scale))


def test_torch_func_takes_the_same_gradients_as_autograd():
    hidden, weight, labels = _inputs(1)
    _, hidden_grad, weight_grad = _loss_and_grads(
        head_cross_entropy_sum, hidden, weight, labels, 0.1, False
    )
    grads = torch.func.grad(
        lambda h, w: head_cross_entropy_sum(h, w, labels, 0.1) * SCALE, argnums=(0, 1)
    )(hidden, weight)
    # the same kernels on the same inputs: the same numbers
    assert torch.equal(grads[0], hidden_grad) and torch.equal(grads[1], weight_grad)


def test_ignored_positions_add_nothing_and_take_no_gradient():
    hidden, weight, labels = _inputs(2)
    labels[1] = IGNORE
    h = hidden.clone().requires_grad_()
    head_cross_entropy_sum(h, weight, labels).backward()
    assert torch.count_nonzero(h.grad[1]) == 0 and torch.count_nonzero(h.grad[0]) > 0
    only_first = head_cross_entropy_sum(hidden[:1], weight, labels[:1])
    # the same terms, summed in chunks of other sizes
    torch.testing.assert_close(
        head_cross_entropy_sum(hidden, weight, labels), only_first, **tolerance(B * T + V)
    )


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
