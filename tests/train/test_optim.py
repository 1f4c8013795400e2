"""Optimizers match torch.optim step for step; schedules keep their shape."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import assert_close

from astrai.config import ScheduleConfig
from astrai.hardware import native_bf16
from astrai.train.optim import (
    AdamState,
    MomentumState,
    MuonState,
    adamw,
    decay_mask,
    fused_adamw_available,
    lion,
    moments,
    muon,
    muon_mask,
    orthogonalize,
    sgd,
)
from astrai.train.schedules import lr_at

# Each optimizer step rounds a handful of times per element (moments, square root, quotient,
# decay, update): at most this many roundings per step.
PER_STEP = 10


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(4, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(4, generator=g),
        "lm_head.weight": torch.randn(10, 4, generator=g),
    }


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=g) for k, v in params.items()}


def _torch_run(params, make, mask, steps, lrs):
    """The same steps through torch.optim, with decay and no-decay parameter groups."""
    tensors = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    groups = [
        {"params": [t for k, t in tensors.items() if mask[k]]},
        {"params": [t for k, t in tensors.items() if not mask[k]], "weight_decay": 0.0},
    ]
    opt = make(groups)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        for k, t in tensors.items():
            t.grad = _grads(params, step)[k]
        opt.step()
    return {k: t.detach() for k, t in tensors.items()}


def _our_run(params, optimizer, steps, lrs):
    params = {k: v.clone() for k, v in params.items()}
    state = optimizer.init(params)
    for step in range(steps):
        params, state = optimizer.update(params, _grads(params, step), state, lrs[step])
    return params


LRS = [1e-2, 2e-2, 5e-3, 1e-2, 1e-3, 3e-2]


def _torch_adamw_run(params, mask, steps):
    """`steps` of torch.optim.AdamW (betas 0.9, 0.95; weight decay 0.1 where `mask` says)."""
    make = lambda g: torch.optim.AdamW(g, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # noqa: E731
    return _torch_run(params, make, mask, steps, LRS)


def test_adamw_matches_torch_step_for_step():
    params = _params()
    mask = decay_mask(params)
    for steps in range(1, len(LRS) + 1):
        ours = _our_run(params, adamw(0.9, 0.95, 1e-8, 0.1, mask), steps, LRS)
        ref = _torch_adamw_run(params, mask, steps)
        for k in params:
            assert_close(ours[k], ref[k], PER_STEP * steps)


def test_fused_adamw_agrees_with_foreach():
    params, mask = _params(), decay_mask(_params())
    a = _our_run(params, adamw(0.9, 0.99, 1e-8, 0.1, mask), 4, LRS)
    b = _our_run(params, adamw(0.9, 0.99, 1e-8, 0.1, mask, fused=True), 4, LRS)
    for k in a:
        assert_close(a[k], b[k], PER_STEP * 4)


def test_fused_adamw_without_the_private_op_runs_the_foreach_path(monkeypatch):
    params, mask = _params(), decay_mask(_params())
    foreach = _our_run(params, adamw(0.9, 0.99, 1e-8, 0.1, mask), 4, LRS)
    monkeypatch.delattr(torch, "_fused_adamw_")  # as in a torch release without it
    assert not fused_adamw_available(torch.device("cpu"))
    fallback = _our_run(params, adamw(0.9, 0.99, 1e-8, 0.1, mask, fused=True), 4, LRS)
    # the same public ops as the foreach path (which matches torch.optim above): bit for bit
    assert all(torch.equal(fallback[k], foreach[k]) for k in params)


def _run_scaled(params, optimizer, steps, lrs, scale, by_optimizer):
    """(params, moments) of _our_run with every gradient times scale: given to the optimizer
    as grad_scale, or multiplied in beforehand."""
    params = {k: v.clone() for k, v in params.items()}
    state = optimizer.init(params)
    for step in range(steps):
        grads = _grads(params, step)
        if by_optimizer:
            params, state = optimizer.update(params, grads, state, lrs[step], grad_scale=scale)
        else:
            grads = {k: g * scale for k, g in grads.items()}
            params, state = optimizer.update(params, grads, state, lrs[step])
    return params, moments(state)


@pytest.mark.parametrize("name", ["adamw", "fused_adamw", "sgd", "lion", "muon"])
def test_grad_scale_is_the_same_as_scaling_the_gradients_first(name):
    """train_step hands its averaging and clipping factor to the optimizer (the fused kernel
    applies it as it reads each gradient): the same update as gradients scaled beforehand."""
    params, mask, scale = _params(), decay_mask(_params()), 0.37
    make = {
        "adamw": lambda: adamw(0.9, 0.99, 1e-8, 0.1, mask),
        "fused_adamw": lambda: adamw(0.9, 0.99, 1e-8, 0.1, mask, fused=True),
        "sgd": lambda: sgd(0.9, weight_decay=0.1, mask=mask),
        "lion": lambda: lion(0.9, 0.99, 0.1, mask),
        "muon": lambda: muon(weight_decay=0.1, mask=mask),
    }[name]
    given, given_moments = _run_scaled(params, make(), 3, LRS, scale, by_optimizer=True)
    first, first_moments = _run_scaled(params, make(), 3, LRS, scale, by_optimizer=False)
    # Adam's step hardly changes with the gradients' scale; its moments show whether it was used.
    pairs = [(given, first)] + [(given_moments[n], first_moments[n]) for n in given_moments]
    for a, b in pairs:
        for k in params:
            if name == "fused_adamw":  # the kernel divides by 1 / scale: a rounding more a step
                assert_close(a[k], b[k], PER_STEP * 3)
            else:  # the same foreach multiply, so bit for bit
                assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_torch(nesterov):
    params = _params()
    mask = decay_mask(params)
    ours = _our_run(params, sgd(0.9, nesterov, 0.0, mask), 5, LRS)
    ref = _torch_run(
        params, lambda g: torch.optim.SGD(g, momentum=0.9, nesterov=nesterov), mask, 5, LRS
    )
    for k in params:
        assert_close(ours[k], ref[k], PER_STEP * 5)


def test_lion_matches_its_definition():
    params, b1, b2, wd = _params(), 0.9, 0.99, 0.1
    mask = decay_mask(params)
    ours = _our_run(params, lion(b1, b2, wd, mask), 4, LRS)
    ref = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    for step in range(4):
        grads, lr = _grads(params, step), LRS[step]
        for k in ref:
            update = torch.sign(b1 * m[k] + (1 - b1) * grads[k])
            decay = wd if mask[k] else 0.0
            ref[k] = ref[k] * (1 - lr * decay) - lr * update
            m[k] = b2 * m[k] + (1 - b2) * grads[k]
    for k in params:
        assert_close(ours[k], ref[k], PER_STEP * 4)


def test_decay_mask_spares_norms_biases_and_embeddings():
    mask = decay_mask(_params())
    assert mask == {
        "model.embed_tokens.weight": False,
        "model.layers.0.self_attn.q_proj.weight": True,
        "model.layers.0.self_attn.q_proj.bias": False,
        "model.layers.0.input_layernorm.weight": False,
        "lm_head.weight": True,
    }
    everything = decay_mask(_params(), True, True, True)
    assert all(everything.values())


def test_optimizers_update_in_place_and_count():
    params = _params()
    before = {k: v.data_ptr() for k, v in params.items()}
    opt = adamw(weight_decay=0.1, mask=decay_mask(params))
    new, state = opt.update(params, _grads(params, 0), opt.init(params), 1e-2)
    assert {k: v.data_ptr() for k, v in new.items()} == before
    assert isinstance(state, AdamState) and state.count == 1
    assert moments(state).keys() == {"m", "v"} and state.m.keys() == params.keys()
    for make in (sgd, lion):
        _, state = make().update(params, _grads(params, 0), make().init(params), 1e-2)
        assert isinstance(state, MomentumState) and state.count == 1
    _, state = muon().update(params, _grads(params, 0), muon().init(params), 1e-2)
    assert isinstance(state, MuonState) and state.count == 1
    # AdamW's second moment only where AdamW runs: none kept for the hidden matrices
    assert [k for k, v in state.v.items() if v.numel() == 0] == [
        "model.layers.0.self_attn.q_proj.weight"
    ]


# --- Muon ---------------------------------------------------------------------------------


def _muon_params():
    """_params with hidden matrices of the three orientations: square, tall and wide."""
    g = torch.Generator().manual_seed(1)
    return _params() | {
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 4, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(4, 12, generator=g),
        "model.layers.1.mlp.up_proj.weight": torch.randn(12, 4, generator=g),
    }


def test_muon_takes_the_hidden_matrices_only():
    assert muon_mask(_muon_params()) == {
        "model.embed_tokens.weight": False,
        "model.layers.0.self_attn.q_proj.weight": True,
        "model.layers.0.self_attn.q_proj.bias": False,
        "model.layers.0.input_layernorm.weight": False,
        "lm_head.weight": False,
        "model.layers.0.mlp.up_proj.weight": True,
        "model.layers.0.mlp.down_proj.weight": True,
        "model.layers.1.mlp.up_proj.weight": True,
    }


@pytest.mark.parametrize("shape", [(16, 16), (48, 16), (16, 48), (3, 24, 8)])
def test_orthogonalize_keeps_the_singular_vectors_and_flattens_the_values(shape):
    """For x = U diag(s) V^T with singular values over 1.5 decades, at any overall scale: the
    result is U diag(s') V^T with every s' near 1 (the five quintic steps trade exactness for
    speed: within about 0.7-1.2). A leading dimension is a batch of independent matrices."""
    g = torch.Generator().manual_seed(0)
    *batch, rows, cols = shape
    k = min(rows, cols)
    u = torch.linalg.qr(torch.randn(*batch, rows, k, generator=g)).Q
    v = torch.linalg.qr(torch.randn(*batch, cols, k, generator=g)).Q
    s = torch.logspace(-1.5, 0, k)[torch.randperm(k, generator=g)]
    x = 1e3 * u @ torch.diag_embed(s) @ v.mT
    inside = u.mT @ orthogonalize(x) @ v  # diag(s') if the singular vectors are kept
    values = torch.diagonal(inside, dim1=-2, dim2=-1)
    assert values.min() > 0.6 and values.max() < 1.25, values
    # five steps, each rounding sums of up to 48 products in the iteration's dtype
    dtype = torch.bfloat16 if native_bf16("cpu") else torch.float32
    atol = 5 * math.sqrt(48) * torch.finfo(dtype).eps
    torch.testing.assert_close(inside, torch.diag_embed(values), rtol=0, atol=atol)
    for i in range(batch[0] if batch else 0):
        torch.testing.assert_close(orthogonalize(x)[i], orthogonalize(x[i]), rtol=0, atol=atol)


def test_muon_matches_its_definition():
    """Step for step against the update written out matrix by matrix (the formula in muon's
    docstring), and AdamW on everything else."""
    params, steps = _muon_params(), 4
    mask, chosen = decay_mask(params), muon_mask(params)
    ours = _our_run(params, muon(0.95, True, 5, 0.9, 0.95, 1e-8, 0.1, mask), steps, LRS)
    all_adam = _torch_adamw_run(params, mask, steps)
    adam_ref = {k: v for k, v in all_adam.items() if not chosen[k]}
    ref = {k: v.clone() for k, v in params.items() if chosen[k]}
    buf = {k: torch.zeros_like(v) for k, v in ref.items()}
    for step in range(steps):
        grads, lr = _grads(params, step), LRS[step]
        for k in ref:
            buf[k] = 0.95 * buf[k] + 0.05 * grads[k]
            direction = 0.05 * grads[k] + 0.95 * buf[k]
            scale = 0.2 * max(ref[k].shape) ** 0.5
            ref[k] = ref[k] * (1 - lr * 0.1) - lr * scale * orthogonalize(direction)
    for k in params:
        assert_close(ours[k], (ref | adam_ref)[k], PER_STEP * steps)


def test_muon_agrees_with_torch_optim_muon():
    """torch.optim.Muon (adjust_lr_fn="match_rms_adamw") runs its Newton-Schulz steps in bf16
    on every device, ours in bf16 where the device multiplies it natively and in float32
    elsewhere: the same updates within bf16's roundings."""
    params = {k: v for k, v in _muon_params().items() if muon_mask(_muon_params())[k]}
    ours = _our_run(params, muon(0.95, weight_decay=0.1), 3, LRS)
    tensors = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.Muon(
        tensors.values(), weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw"
    )
    for step in range(3):
        opt.param_groups[0]["lr"] = LRS[step]
        for k, t in tensors.items():
            t.grad = _grads(params, step)[k]
        opt.step()
    for k in params:
        moved_ours, moved_torch = ours[k] - params[k], tensors[k].detach() - params[k]
        # torch's iterate rounds to bf16 (8 bits) at each of its 5 steps, in each of 3 updates
        atol = 8 * 2**-8 * moved_torch.abs().max().item()
        torch.testing.assert_close(moved_ours, moved_torch, rtol=0, atol=atol)


# --- schedules ----------------------------------------------------------------------------


def test_warmup_then_cosine_ends_at_the_floor():
    sched = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, sched, 1.0, 100) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))  # non-increasing after warmup
    assert lrs[100] == pytest.approx(0.1)


def test_sgdr_restarts_with_growing_cycles():
    sched = ScheduleConfig(name="sgdr", cycle_steps=10, cycle_mult=2.0, min_lr_ratio=0.0)
    lrs = [lr_at(s, sched, 1.0, 100) for s in range(70)]
    restarts = [s for s in range(1, 70) if lrs[s] > lrs[s - 1] + 1e-9]
    assert restarts == [10, 30]  # cycles of 10, 20, 40 steps
    assert lrs[0] == lrs[10] == lrs[30] == pytest.approx(1.0)


def test_wsd_holds_then_decays():
    sched = ScheduleConfig(name="wsd", warmup_steps=5, decay_fraction=0.2, min_lr_ratio=0.0)
    lrs = [lr_at(s, sched, 2.0, 100) for s in range(101)]
    assert all(lr == 2.0 for lr in lrs[5:80])
    assert lrs[90] == pytest.approx(1.0) and lrs[100] == pytest.approx(0.0)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["constant", "cosine", "sgdr", "wsd"]),
    warmup=st.integers(0, 50),
    total=st.integers(1, 500),
    step=st.integers(0, 600),
    floor=st.floats(0.0, 1.0),
)
def test_every_schedule_stays_between_zero_and_peak(name, warmup, total, step, floor):
    sched = ScheduleConfig(name=name, warmup_steps=warmup, min_lr_ratio=floor, cycle_steps=7)
    lr = lr_at(step, sched, 3e-4, total)
    assert math.isfinite(lr) and 0.0 <= lr <= 3e-4 * (1 + 1e-9)
    if step < warmup or floor > 1e-6:
        assert lr > 0.0
