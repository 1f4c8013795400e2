"""GRPO with online rollouts: the Engine samples with the policy's params, its log-probs are the
model's, the batch feeds the loss the right numbers, rewards rise, failures lose nothing, and a
resumed run ends where a straight one does."""

from __future__ import annotations

import importlib.util
import json

import msgspec
import pytest
import tokenizers
import torch
from numerics import approx, assert_close, forward_roundings
from tiny_run import ROOT, TINY_MODEL, same_tensors, tiny_config
from tokenizers import models, pre_tokenizers

from astrai.config import ConfigError, LossConfig, ModelConfig, train_config
from astrai.data import data_config, prepare
from astrai.eval.scoring import final_answer, load_reward
from astrai.infer import speculate_step
from astrai.model import forward, init_params, save_pretrained, token_logps
from astrai.tokenizer import Tokenizer
from astrai.train import (
    RewardError,
    Samples,
    build_batch,
    group_advantages,
    latest_checkpoint,
    load_train_state,
    loss_fn,
    request_seed,
    sample_group,
    train,
)
from astrai.train.metrics import read_metrics
from astrai.train.rewards import equation_format, exact_match

WORDS = ["<|endoftext|>", *"0123456789", "+", "="]
MODEL = {**TINY_MODEL, "vocab_size": len(WORDS), "max_position_embeddings": 32}
CFG = ModelConfig(**MODEL)


def word_tokenizer() -> Tokenizer:
    """One token per digit or sign, so a tiny model starts near uniform over a few choices."""
    backend = tokenizers.Tokenizer(models.WordLevel(dict(zip(WORDS, range(len(WORDS)))), WORDS[0]))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Whitespace()]
    )
    backend.add_special_tokens([WORDS[0]])
    return Tokenizer(backend, eos_token=WORDS[0], pad_token=WORDS[0])


# Reward functions named by dotted path in the configs below.
def first_is_seven(prompts, completions, **_):
    return [float(c.split()[:1] == ["7"]) for c in completions]


CALLS = {"n": 0}


def fails_on_second_round(prompts, completions, **_):
    CALLS["n"] += 1
    if CALLS["n"] == 2:
        raise KeyError("no score for this one")
    return first_is_seven(prompts, completions)


@pytest.fixture(scope="module")
def prompts_dir(tmp_path_factory):
    """A tokenizer folder and a prepared grpo dataset of a dozen prompts."""
    root = tmp_path_factory.mktemp("grpo")
    word_tokenizer().save_pretrained(root / "tok")
    records = [{"prompt": f"{i} + {i % 3}", "answer": str(i + i % 3)} for i in range(12)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    keys = {"tokenizer": str(root / "tok"), "inputs": [str(root / "prompts.jsonl")]}
    keys |= {"output": str(root / "data"), "kind": "grpo", "template": "plain"}
    prepare(data_config({**keys, "max_seq_len": 16, "progress": False}), log=None)
    return root


def grpo_config(root, out, reward="first_is_seven", **overrides):
    cfg = tiny_config(
        kind="grpo",
        out_dir=str(out),
        tokenizer=str(root / "tok"),
        model=MODEL,
        max_steps=16,
        batch_size=16,
        log_every=4,
        optimizer={"lr": 1e-2, "weight_decay": 0.0},
        loss={"grpo_kl_beta": 0.0},
        data={"source": "shards", "train": str(root / "data")},
        grpo={
            "group_size": 4,
            "prompts_per_round": 4,
            "max_new_tokens": 2,
            "rewards": [f"{__name__}.{reward}"],
        },
    )
    cfg.update(overrides)
    return train_config(cfg, "test")


def grpo_config_dict():
    cfg = tiny_config(kind="grpo", model=MODEL, batch_size=8)
    cfg["grpo"] = {"group_size": 4, "prompts_per_round": 2, "temperature": 0.7, "max_new_tokens": 6}
    return cfg


def test_builtin_rewards_read_the_final_answer():
    assert final_answer("12 + 30 = 42") == "42" and final_answer("it is 7, or 8") == "8"
    assert final_answer("= x") is None
    completions = ["12 + 30 = 42", "12 + 30 = 42.0", "12+30=41", "42", "hello"]
    assert exact_match([""] * 5, completions, answer=["42"] * 5) == [1, 1, 0, 1, 0]
    assert equation_format([""] * 5, completions) == [1, 0, 1, 0, 0]
    assert exact_match([""], ["1 = 1"]) == [0.0]  # a record without an answer
    assert load_reward("astrai.train.rewards.exact_match") is exact_match
    with pytest.raises(ValueError, match=r"nowhere\.reward"):
        load_reward("nowhere.reward")


@pytest.mark.parametrize("speculative", [False, True])
def test_rollout_logprobs_are_the_models_raw_logprobs(speculative, tmp_path, monkeypatch):
    """Sampled at temperature 0.7, the log-probs the rollout reports (the old policy) equal
    log_softmax of the raw logits that `forward` recomputes: the loss's own quantity. With
    speculative decoding too (the policy as its own draft, verifying every proposal), whose
    kept tokens' log-probs come from the verify forward."""
    params = init_params(CFG, seed=3)
    grpo = train_config(grpo_config_dict(), "test").grpo
    if speculative:
        save_pretrained(tmp_path, params, CFG)
        grpo = msgspec.structs.replace(grpo, speculative="draft", draft_model=str(tmp_path))
        monkeypatch.setattr(speculate_step, "worth_verifying", lambda *a: True)
    prompts = [[1, 11, 2], [5, 5, 12, 9, 4]]
    seeds = [request_seed(0, 0, i) for i in range(2 * grpo.group_size)]
    samples = sample_group(params, CFG, word_tokenizer(), prompts, grpo, seeds)
    again = sample_group(params, CFG, word_tokenizer(), prompts, grpo, seeds)
    assert samples.completion_ids == again.completion_ids  # seeded: the same completions
    assert samples.group_ids == [0] * 4 + [1] * 4
    batch = build_batch(samples, torch.zeros(8), scale=True)
    mask = batch["labels"] != -100
    recomputed = token_logps(forward(params, CFG, batch["input_ids"]).float(), batch["labels"])
    assert mask.sum() == sum(len(c) for c in samples.completion_ids)
    # the Engine's paged prefill/decode against one forward pass, and a log_softmax over V
    roundings = forward_roundings(CFG, batch["input_ids"].shape[1]) + CFG.vocab_size
    assert_close(batch["old_logps"][mask], recomputed[mask], roundings)


def test_rollout_batch_feeds_the_loss_what_each_row_alone_would():
    """Padding, label alignment and advantages of `build_batch`: the loss over the padded
    batch is the token-weighted mean of the loss of each row alone (tests/train/test_losses.py
    checks that loss against a per-token reference), with group-normalised advantages."""
    params = init_params(CFG, seed=4)
    samples = Samples(
        prompt_ids=[[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]],
        completion_ids=[[7, 0], [6, 6, 6], [9], [2, 3, 0]],
        logprobs=[[-2.0, -1.5], [-2.5, -2.4, -2.3], [-2.2], [-2.6, -2.0, -1.1]],
        texts=["", "", "", ""],
        group_ids=[0, 0, 1, 1],
        truncated=[False, True, False, False],
    )
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0])
    batch = build_batch(samples, rewards, scale=True, pad_id=0)
    adv = group_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    assert_close(batch["advantages"], adv, 8)  # a mean and a std of 2, a quotient
    assert batch["input_ids"][1].tolist() == [1, 2, 3, 6, 6, 6]
    assert batch["labels"][1].tolist() == [-100, -100, 6, 6, 6, -100]
    assert batch["old_logps"][0, 2:4].tolist() == [-2.0, -1.5]
    opts = LossConfig(grpo_clip_high=0.28, grpo_kl_beta=0.05)
    loss, _ = loss_fn(params, CFG, {**batch, "ref_logps": batch["old_logps"] - 0.1}, "grpo", opts)
    total, count = 0.0, 0
    for b in range(4):
        n = len(samples.prompt_ids[b]) + len(samples.completion_ids[b])
        row = {k: v[b : b + 1, :n] for k, v in batch.items() if k != "advantages"}
        row |= {"advantages": adv[b : b + 1], "ref_logps": row["old_logps"] - 0.1}
        row_loss, metrics = loss_fn(params, CFG, row, "grpo", opts)
        total += row_loss.item() * metrics["weight"].item()
        count += len(samples.completion_ids[b])
    # padded rows change the forward's sums; then log_softmax over V and a mean over 9 tokens
    assert loss.item() == approx(total / count, forward_roundings(CFG, 6) + CFG.vocab_size + 9)


def test_rewards_rise_on_a_learnable_reward(prompts_dir, tmp_path):
    state = train(grpo_config(prompts_dir, tmp_path, max_steps=24))
    rounds = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward_mean" in r]
    assert len(rounds) == 24  # one optimizer step per round (16 completions, batch_size 16)
    first, last = rounds[0], rounds[-1]
    assert {"reward_std/first_is_seven", "clip_fraction_mean", "rollout_tokens_per_s"} <= set(last)
    assert {"completion_len_mean", "rollout_s", "train_s"} <= set(last)
    early = sum(r["reward_mean"] for r in rounds[:4]) / 4
    late = sum(r["reward_mean"] for r in rounds[-4:]) / 4
    assert early < 0.3 and late > 0.7, (early, late)
    assert state.step == 24 and state.cursor["position"] + state.cursor["epoch"] > 0
    assert first["step"] == 1
    plot = load_program("plot")  # `just plot` draws the reward curve, one line per function
    panels = {
        title: series for title, _, series in plot.curves(read_metrics(tmp_path / "metrics.jsonl"))
    }
    assert [name for name, _, _ in panels["GRPO reward"]] == [
        "reward_mean",
        "reward_mean/first_is_seven",
    ]


def load_program(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "programs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_raising_reward_is_named_and_nothing_trained_is_lost(prompts_dir, tmp_path):
    CALLS["n"] = 0
    cfg = grpo_config(prompts_dir, tmp_path, reward="fails_on_second_round")
    with pytest.raises(RewardError, match=r"test_grpo\.fails_on_second_round raised KeyError"):
        train(cfg)
    # the first round's step was saved before the error went up, and resumes cleanly
    saved = load_train_state(latest_checkpoint(tmp_path), cfg)
    assert saved.step == 1 and saved.cursor["position"] == 4
    cfg = grpo_config(prompts_dir, tmp_path, max_steps=2)
    assert train(cfg).step == 2


def test_resumed_run_ends_where_the_straight_run_does(prompts_dir, tmp_path):
    grpo = {
        "group_size": 4,
        "prompts_per_round": 4,
        "max_new_tokens": 3,
        "epochs": 2,
        "temperature": 0.9,
        "rewards": [f"{__name__}.first_is_seven"],
    }
    common = dict(batch_size=8, grpo=grpo, checkpoint_every=4, loss={"grpo_kl_beta": 0.05})
    straight = train(grpo_config(prompts_dir, tmp_path / "a", max_steps=12, **common))
    train(grpo_config(prompts_dir, tmp_path / "b", max_steps=4, **common))
    resumed = train(grpo_config(prompts_dir, tmp_path / "b", max_steps=12, **common))
    assert resumed.step == straight.step == 12
    assert resumed.cursor == straight.cursor
    assert same_tensors(resumed.params, straight.params)
    a = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "reward_mean" in r]
    b = [r for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "reward_mean" in r]
    assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"batch_size": 6}, ["completions per round", "batch_size"]),
        ({"checkpoint_every": 3}, ["checkpoint_every", "grpo round"]),
        ({"grpo": {"group_size": 1}}, ["group_size"]),
        ({"grpo": {"rewards": ["a.b", "c.d"], "reward_weights": [1.0]}}, ["reward_weights"]),
        ({"grpo": {"temperature": 0.0}}, ["temperature"]),
        ({"grpo": {"speculative": "draft"}}, ["needs draft_model"]),
        ({"grpo": {"speculative": "lookup", "speculative_k": 0}}, ["speculative_k"]),
    ],
)
def test_bad_grpo_settings_name_the_key(overrides, words):
    cfg = tiny_config(kind="grpo", batch_size=8, data={"source": "shards", "train": "x"})
    for key, value in overrides.items():
        cfg[key] = value
    with pytest.raises(ConfigError) as info:
        train_config(cfg, "run.toml")
    assert all(w in str(info.value) for w in words), str(info.value)
