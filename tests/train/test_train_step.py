"""train_step: losses fall for every kind, accumulation and LoRA behave, bad steps are skipped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from numerics import approx, assert_close, forward_roundings, gradient_roundings
from tiny_run import TINY, same_tensors, tiny_train_config

from astrai.model import forward, init_params, masked_attention, token_logps
from astrai.train import (
    TrainingDiverged,
    compiling,
    init_train_state,
    step,
    synthetic_batch,
    train_step,
    with_reference_logps,
)
from astrai.train.batches import GRPO_GROUP
from astrai.train.compiling import AUTO_MIN_STEPS, compiler_missing, should_compile


def _batch(kind, index, rows=8, seq_len=16):
    return synthetic_batch(kind, 0, index, rows, seq_len, TINY.vocab_size)


# Tests that compare two ways of computing the same step train with SGD: its update is linear in
# the gradient, so rounding differences stay rounding-sized. Adam's first step is
# lr * g / (|g| + eps_adam): a gradient near eps_adam turns its rounding into a step up to lr.
SGD = {"name": "sgd", "lr": 0.5, "max_grad_norm": 0.0}
# two steps of 8 rows x 16 tokens
TWO_SGD_STEPS = 2 * gradient_roundings(TINY, 16, 8 * 16)


def _train(kind, steps, **overrides):
    cfg = tiny_train_config(kind=kind, **overrides)
    params = init_params(TINY, seed=0)
    reference = {k: v.clone() for k, v in params.items()}
    state = init_train_state(params, cfg)
    history = []
    for i in range(steps):
        batch = with_reference_logps(_batch(kind, i), kind, reference, TINY, cfg.loss)
        state, metrics = train_step(state, batch)
        history.append(metrics)
    return state, history


@pytest.mark.parametrize("kind, optimizer", [("seq", "adamw"), ("sft", "adamw"), ("seq", "muon")])
def test_next_token_losses_fall(kind, optimizer):
    _, history = _train(kind, 30, optimizer={"name": optimizer, "lr": 3e-3, "weight_decay": 0.0})
    first, last = history[0]["loss"], sum(m["loss"] for m in history[-5:]) / 5
    assert last < 0.8 * first


def test_dpo_learns_to_prefer_chosen():
    _, history = _train("dpo", 30, loss={"dpo_beta": 0.5})
    assert history[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2 before any update
    assert history[-1]["loss"] < 0.4
    assert history[-1]["reward_accuracy"] == 1.0


def _correct_logp(params, seed=99):
    """Mean log-prob of the correct (counting) completions of fresh prompts."""
    batch = synthetic_batch("sft", seed, 0, 8, 16, TINY.vocab_size)
    with torch.no_grad():
        logp = token_logps(forward(params, TINY, batch["input_ids"]), batch["labels"])
    return (logp.sum() / (batch["labels"] != -100).sum()).item()


def test_grpo_raises_the_probability_of_rewarded_completions():
    before = _correct_logp(init_params(TINY, seed=0))
    state, history = _train("grpo", 40, loss={"grpo_kl_beta": 0.01})
    assert _correct_logp(state.params) > before + 0.4
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in history)
    assert history[-1]["kl"] > 0


def test_accumulation_equals_one_big_batch():
    """Token-weighted micro-batches: 4 micro-batches of unequal label counts give the update
    of the whole batch at once."""
    batch = _batch("sft", 0)
    batch["labels"][:2, :10] = -100  # rows with fewer trained tokens
    results = []
    for accum in (1, 4):
        cfg = tiny_train_config(kind="sft", grad_accum=accum, optimizer=SGD)
        state = init_train_state(init_params(TINY, seed=0), cfg)
        for _ in range(2):
            state, metrics = train_step(state, batch)
        results.append((state.params, metrics["loss"]))
    for k in results[0][0]:
        assert_close(results[0][0][k], results[1][0][k], TWO_SGD_STEPS)
    assert results[0][1] == approx(results[1][1], TWO_SGD_STEPS)


def test_a_list_of_micro_batches_is_taken_as_given():
    batch = _batch("seq", 0)
    cfg = tiny_train_config(optimizer=SGD)
    whole, _ = train_step(init_train_state(init_params(TINY), cfg), batch)
    parts = [{k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}]
    split, _ = train_step(init_train_state(init_params(TINY), cfg), parts)
    for k in whole.params:
        assert_close(whole.params[k], split.params[k], TWO_SGD_STEPS / 2)
    assert any(not torch.equal(whole.params[k], init_params(TINY)[k]) for k in whole.params)


def test_lora_trains_only_the_adapters():
    cfg = tiny_train_config(lora={"rank": 4, "alpha": 8.0}, optimizer={"lr": 1e-2})
    params = init_params(TINY, seed=0)
    frozen = {k: v.clone() for k, v in params.items()}
    state = init_train_state(params, cfg)
    start = {k: {n: t.clone() for n, t in v.items()} for k, v in state.lora["weights"].items()}
    losses = []
    for i in range(25):
        state, metrics = train_step(state, _batch("seq", i))
        losses.append(metrics["loss"])
    assert same_tensors(state.params, frozen)
    moved = [not torch.equal(start[k]["B"], v["B"]) for k, v in state.lora["weights"].items()]
    assert all(moved)
    assert losses[-1] < losses[0]


def test_activation_checkpointing_gives_the_same_step():
    results = []
    for ckpt in (False, True):
        cfg = tiny_train_config(activation_checkpointing=ckpt, optimizer=SGD)
        state = init_train_state(init_params(TINY), cfg)
        for i in range(2):
            state, _ = train_step(state, _batch("seq", i))
        results.append(state.params)
    for k in results[0]:
        assert_close(results[0][k], results[1][k], TWO_SGD_STEPS)


def _bad_batch(index):
    batch = synthetic_batch("grpo", 0, index, GRPO_GROUP * 2, 16, TINY.vocab_size)
    return {**batch, "advantages": torch.full((GRPO_GROUP * 2,), float("nan"))}


def test_non_finite_steps_are_skipped_and_then_stop_training():
    cfg = tiny_train_config(kind="grpo", max_bad_steps=3, loss={"grpo_kl_beta": 0.0})
    state = init_train_state(init_params(TINY), cfg)
    state, _ = train_step(state, _batch("grpo", 0))
    params = {k: v.clone() for k, v in state.params.items()}
    moments = {k: v.clone() for k, v in state.opt.m.items()}
    state, metrics = train_step(state, _bad_batch(1))
    assert metrics["step_skipped"] and metrics["skipped"] == 1
    assert same_tensors(state.params, params) and same_tensors(state.opt.m, moments)
    assert state.opt.count == 1 and state.step == 2
    state, _ = train_step(state, _bad_batch(2))
    state, metrics = train_step(state, _batch("grpo", 3))  # a good step resets the streak
    assert state.bad_streak == 0 and metrics["skipped"] == 2
    state, _ = train_step(state, _bad_batch(4))
    state, _ = train_step(state, _bad_batch(5))
    with pytest.raises(TrainingDiverged, match="3 steps in a row"):
        train_step(state, _bad_batch(6))


def test_compile_falls_back_to_eager_with_a_message(monkeypatch, capsys):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C compiler found")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    eager_cfg = tiny_train_config(max_steps=21)  # the engine the compiled layers run under
    eager = init_train_state(init_params(TINY), eager_cfg)
    compiled = init_train_state(init_params(TINY), tiny_train_config(max_steps=21, compile=True))
    for i in range(2):
        eager, _ = train_step(eager, _batch("seq", i))
        compiled, _ = train_step(compiled, _batch("seq", i))
    assert "torch.compile failed" in capsys.readouterr().err
    assert same_tensors(eager.params, compiled.params)


def test_compile_auto_compiles_only_long_runs_with_a_compiler(monkeypatch, capsys):
    cpu = torch.device("cpu")
    long_run = tiny_train_config(max_steps=AUTO_MIN_STEPS)
    assert not should_compile(tiny_train_config(max_steps=AUTO_MIN_STEPS - 1), cpu)
    assert not should_compile(tiny_train_config(max_steps=AUTO_MIN_STEPS, compile=False), cpu)
    assert should_compile(tiny_train_config(max_steps=2, compile=True), cpu)
    checkpointed = tiny_train_config(max_steps=AUTO_MIN_STEPS, activation_checkpointing=True)
    assert not should_compile(checkpointed, cpu)
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert not should_compile(long_run, cpu) and not should_compile(long_run, cpu)
    err = capsys.readouterr().err
    assert err.count("no C++ compiler") == 1 and "eager mode" in err  # said once
    monkeypatch.setattr(compiling.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert should_compile(long_run, cpu)


def test_compiled_graphs_are_cached_in_the_users_cache_not_tmp(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    family = torch.backends.cpu.get_cpu_capability().lower()
    mine = str(tmp_path / "cache" / "astrai" / "inductor" / family)
    for unset in (None, default_cache_dir()):  # torch writes its /tmp default when imported
        if unset is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", unset)
        compiling.use_user_cache_dir()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == mine
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))
    compiling.use_user_cache_dir()  # the user's own choice stays
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "chosen")


def test_each_family_of_cpu_kernels_has_a_cache_of_its_own(tmp_path):
    # kernels built under one family and read under another gave non-finite losses
    folders = {}
    for family in ("default", "avx2"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": family, "XDG_CACHE_HOME": str(tmp_path)}
        code = "from astrai.train import compiling; print(compiling.user_cache_dir())"
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        folders[family] = done.stdout.strip()
    assert folders["default"] != folders["avx2"]
    assert all(f.startswith(str(tmp_path / "astrai" / "inductor")) for f in folders.values())


@pytest.mark.skipif(compiler_missing(torch.device("cpu")) is not None, reason="no C++ compiler")
@pytest.mark.parametrize("attention", ["fused", "products"])
def test_compiled_and_eager_steps_give_the_same_loss_curve(
    attention, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # each attention path, whichever this dtype and machine take (masked_attention.py); the
    # choice is a constant of a compiled graph, so the graphs of the other path are dropped
    monkeypatch.setattr(masked_attention, "_products_pay", lambda q, k: attention == "products")
    monkeypatch.setattr(step, "_GRAD_FNS", {})
    torch._dynamo.reset()
    steps = 4
    curves = {}
    for compile_it in (False, True):
        cfg = tiny_train_config(max_steps=steps, compile=compile_it, optimizer=SGD)
        state, curve = init_train_state(init_params(TINY, seed=0), cfg), []
        for i in range(steps):
            state, metrics = train_step(state, _batch("seq", i, seq_len=16))
            curve.append(metrics["loss"])
        curves[compile_it] = curve
    assert "compiled the decoder layer in" in capsys.readouterr().err
    # Each loss is a forward pass on params that took i SGD steps, each step a gradient whose
    # roundings differ between inductor's fused kernels and eager's (and between the engines).
    for i, (eager, compiled_loss) in enumerate(zip(curves[False], curves[True])):
        roundings = (i + 1) * gradient_roundings(TINY, 16, 8 * 16)
        assert compiled_loss == approx(eager, roundings)


def test_bfloat16_keeps_float32_weights_and_moments_so_small_updates_survive():
    # precision = "bfloat16" is mixed precision: the products run in bf16 under autocast, the
    # weights and AdamW's moments stay float32. An update a thousandth of a weight is below
    # bf16's resolution (2**-8 relative): stored in bf16 it would round away, in float32 it lands.
    lr = 1e-3 * init_params(TINY, seed=0)["model.embed_tokens.weight"].abs().mean().item()
    states = {}
    for precision in ("float32", "bfloat16"):
        cfg = tiny_train_config(
            precision=precision, optimizer={"lr": lr, "weight_decay": 0.0}, compile=False
        )
        state = init_train_state(init_params(TINY, seed=0), cfg)
        state, metrics = train_step(state, _batch("seq", 0))
        states[precision] = (state, metrics["loss"])
    (bf16, bf16_loss), f32_loss = states["bfloat16"], states["float32"][1]
    start = init_params(TINY, seed=0)
    tensors = [*bf16.params.values(), *bf16.opt.m.values(), *bf16.opt.v.values()]
    assert {t.dtype for t in tensors} == {torch.float32}
    moved = torch.cat([(bf16.params[k] != start[k]).flatten() for k in start])
    assert moved.float().mean() > 0.9  # Adam's first step moves every weight with a gradient
    # The forward did compute in bf16: the loss differs from float32's by bf16 rounding.
    assert bf16_loss != f32_loss
    assert bf16_loss == approx(f32_loss, forward_roundings(TINY, 16), torch.bfloat16)
