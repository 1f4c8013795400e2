"""Each loss equals a plain reference computation written out here."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import approx, assert_close, forward_roundings
from tiny_run import TINY, TINY_MOE

from astrai.config import LossConfig
from astrai.model import forward, init_params
from astrai.train.losses import group_advantages, loss_fn

V = TINY.vocab_size
# The loss's forward pass against the reference's, then a log_softmax over V per token and a
# mean over up to 3 x 10 tokens.
CE_ROUNDINGS = forward_roundings(TINY, 10) + V + 30
# DPO: each sequence's log-prob sums up to 11 such token log-probs, and the margin subtracts
# the rejected one from the chosen one.
DPO_ROUNDINGS = 2 * 11 * (forward_roundings(TINY, 11) + V)
# GRPO: exp(logp - old) with |logp - old| up to ~8 magnifies each log-prob's rounding.
GRPO_ROUNDINGS = 8 * (forward_roundings(TINY, 9) + V) + 36


def _ids(seed, B=3, T=10):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _labels(ids, masked_prefix=0):
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, :masked_prefix] = -100
    return labels


def _logprob(logits, b, t, token):
    return torch.log_softmax(logits[b, t].double(), -1)[token].item()


def _reference_ce(logits, labels, smoothing):
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            y = labels[b, t].item()
            if y == -100:
                continue
            logp = torch.log_softmax(logits[b, t].double(), -1)
            total += -(1 - smoothing) * logp[y].item() - smoothing * logp.mean().item()
            count += 1
    return total / count


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_seq_loss_is_mean_next_token_cross_entropy(smoothing):
    params, ids = init_params(TINY, seed=1), _ids(0)
    loss, metrics = loss_fn(
        params, TINY, {"input_ids": ids}, "seq", LossConfig(label_smoothing=smoothing)
    )
    logits = forward(params, TINY, ids)
    assert loss.item() == approx(_reference_ce(logits, _labels(ids), smoothing), CE_ROUNDINGS)
    assert metrics["weight"].item() == ids.shape[0] * (ids.shape[1] - 1)


def test_sft_loss_trains_only_labelled_tokens():
    params, ids = init_params(TINY, seed=1), _ids(1)
    labels = _labels(ids, masked_prefix=6)
    loss, metrics = loss_fn(params, TINY, {"input_ids": ids, "labels": labels}, "sft")
    assert loss.item() == approx(
        _reference_ce(forward(params, TINY, ids), labels, 0.0), CE_ROUNDINGS
    )
    assert metrics["weight"].item() == (labels != -100).sum().item()
    with pytest.raises(ValueError, match="labels"):
        loss_fn(params, TINY, {"input_ids": ids}, "sft")


def test_moe_aux_loss_is_added_with_its_coefficient():
    params, ids = init_params(TINY_MOE, seed=2), _ids(2)
    batch = {"input_ids": ids, "labels": _labels(ids)}
    without, _ = loss_fn(params, TINY_MOE, batch, "seq", LossConfig(aux_loss_coef=0.0))
    with_aux, metrics = loss_fn(params, TINY_MOE, batch, "seq", LossConfig(aux_loss_coef=0.5))
    _, aux = forward(params, TINY_MOE, ids, return_aux=True)
    # the same forward pass three times, then one product and one sum
    assert with_aux.item() == approx(without.item() + 0.5 * aux.item(), 4)
    assert metrics["aux_loss"].item() == approx(0.5 * aux.item(), 4)


def _pair_batch(seed):
    chosen, rejected = _ids(seed, T=8), _ids(seed + 1, T=11)
    return {
        "chosen_ids": chosen,
        "chosen_labels": _labels(chosen, 3),
        "rejected_ids": rejected,
        "rejected_labels": _labels(rejected, 3),
        "ref_chosen_logps": torch.tensor([-30.0, -25.0, -28.0]),
        "ref_rejected_logps": torch.tensor([-31.0, -20.0, -35.0]),
    }


def _reference_seq_logp(params, ids, labels, reduction):
    logits = forward(params, TINY, ids)
    out = []
    for b in range(ids.shape[0]):
        terms = [
            _logprob(logits, b, t, labels[b, t].item())
            for t in range(ids.shape[1])
            if labels[b, t] != -100
        ]
        out.append(sum(terms) / (len(terms) if reduction == "mean" else 1))
    return out


@pytest.mark.parametrize(
    "opts",
    [
        LossConfig(dpo_beta=0.1),
        LossConfig(dpo_beta=0.5, dpo_label_smoothing=0.2),
        LossConfig(dpo_beta=0.1, dpo_loss="ipo", logp_reduction="mean"),
    ],
)
def test_dpo_loss_matches_the_formula(opts):
    params, batch = init_params(TINY, seed=3), _pair_batch(3)
    loss, metrics = loss_fn(params, TINY, batch, "dpo", opts)
    r = opts.logp_reduction
    pc = _reference_seq_logp(params, batch["chosen_ids"], batch["chosen_labels"], r)
    pr = _reference_seq_logp(params, batch["rejected_ids"], batch["rejected_labels"], r)
    expected, beta, ls = [], opts.dpo_beta, opts.dpo_label_smoothing
    for i in range(3):
        h = (pc[i] - batch["ref_chosen_logps"][i].item()) - (
            pr[i] - batch["ref_rejected_logps"][i].item()
        )
        if opts.dpo_loss == "ipo":
            expected.append((h - 1 / (2 * beta)) ** 2)
        else:
            sig = 1 / (1 + math.exp(-beta * h))
            expected.append(-(1 - ls) * math.log(sig) - ls * math.log(1 - sig))
    assert loss.item() == approx(sum(expected) / 3, DPO_ROUNDINGS)
    assert metrics["weight"].item() == 3


def test_group_advantages_normalise_within_groups():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 3.0, 1.0])
    groups = torch.tensor([7, 7, 2, 2, 7, 9])
    adv = group_advantages(rewards, groups)
    g7 = torch.tensor([1.0, 0.0, 3.0])
    expected7 = (g7 - g7.mean()) / (g7.std(unbiased=False) + 1e-4)
    assert_close(adv[[0, 1, 4]], expected7, 8)  # a mean and a std of 3, a quotient
    assert adv[2] == adv[3] == 0 and adv[5] == 0  # equal rewards, a group of one
    centred = group_advantages(rewards, groups, scale=False)
    assert_close(centred[[0, 1, 4]], g7 - g7.mean(), 4)


@pytest.mark.parametrize("averaging", ["token", "sequence"])
def test_grpo_loss_matches_per_token_reference(averaging):
    params, ids = init_params(TINY, seed=4), _ids(4, B=4, T=9)
    labels = _labels(ids, masked_prefix=4)
    labels[1, 6:] = -100  # rows of different completion lengths
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(4, 9, generator=g) * 4 - 1
    ref = -torch.rand(4, 9, generator=g) * 4 - 1
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    opts = LossConfig(
        grpo_clip_low=0.2, grpo_clip_high=0.28, grpo_kl_beta=0.05, grpo_averaging=averaging
    )
    batch = {
        "input_ids": ids,
        "labels": labels,
        "advantages": adv,
        "old_logps": old,
        "ref_logps": ref,
    }
    loss, _ = loss_fn(params, TINY, batch, "grpo", opts)
    logits = forward(params, TINY, ids)
    rows = []
    for b in range(4):
        terms = []
        for t in range(9):
            y = labels[b, t].item()
            if y == -100:
                continue
            logp = _logprob(logits, b, t, y)
            ratio = math.exp(logp - old[b, t].item())
            clipped = min(max(ratio, 0.8), 1.28)
            surrogate = min(ratio * adv[b].item(), clipped * adv[b].item())
            d = ref[b, t].item() - logp
            terms.append(-surrogate + 0.05 * (math.exp(d) - d - 1))
        rows.append(terms)
    if averaging == "token":
        expected = sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    else:
        expected = sum(sum(r) / len(r) for r in rows) / len(rows)
    assert loss.item() == approx(expected, GRPO_ROUNDINGS)


def test_grpo_advantages_come_from_rewards_when_missing():
    params, ids = init_params(TINY, seed=4), _ids(6, B=4, T=8)
    labels = _labels(ids, masked_prefix=3)
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    opts = LossConfig(grpo_kl_beta=0.0)
    from_rewards, _ = loss_fn(
        params,
        TINY,
        {"input_ids": ids, "labels": labels, "rewards": rewards, "group_ids": groups},
        "grpo",
        opts,
    )
    adv = group_advantages(rewards, groups)
    given, _ = loss_fn(
        params, TINY, {"input_ids": ids, "labels": labels, "advantages": adv}, "grpo", opts
    )
    assert from_rewards.item() == approx(given.item(), 8)  # advantages computed in two places


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind"):
        loss_fn(init_params(TINY), TINY, {"input_ids": _ids(0)}, "ppo")
