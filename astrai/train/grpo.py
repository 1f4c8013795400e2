"""GRPO with online rollouts: the policy's current params go straight to the inference core
(`run_requests`, on the training thread), which samples a group of completions per prompt;
reward functions score them; the GRPO loss trains on them through `run_step`. One round, as
functions:

    cursor, prompts = source.next(cursor)          # the grpo dataset, by data cursor
    samples = sample_group(params, model_cfg, tokenizer, prompt_ids, grpo_cfg, seeds)
    rewards = score(reward_fns, prompt texts, completion texts, record fields)
    batch = build_batch(samples, total_reward(rewards, weights), scale)
    for part in step_batches(batch, ...): state, _ = run_step(state, part, run)

Old-policy log-probs are the sampling log-probs: log_softmax of the raw logits, the
same quantity `grpo_loss` computes. Temperature, top-p and top-k only choose which completions
are explored; the policy that the ratio and the KL speak of is the untempered model, so the
ratio is 1 at a round's first step whatever the sampling settings.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import numpy as np
import torch

from astrai.config import GrpoConfig, ModelConfig, TrainConfig
from astrai.data import IGNORE, next_batch, open_dataset
from astrai.eval.scoring import Reward, call_reward, load_reward, record_fields
from astrai.infer import Request, init_engine, prepare_params, run_requests
from astrai.infer.resolve import params_for
from astrai.infer.sampling import sampling_params
from astrai.tokenizer import Tokenizer
from astrai.train.batches import BatchSource, rows_per_rank, start_cursor
from astrai.train.checkpoint import checkpoint_path
from astrai.train.distributed import all_reduce_sum_
from astrai.train.losses import group_advantages
from astrai.train.metrics import append_metrics, show_progress
from astrai.train.model_folder import run_tokenizer
from astrai.train.run import Run, run_step, save_checkpoint
from astrai.train.state import TrainState, model_params


class Samples(NamedTuple):
    """A round's completions, one row each; a prompt's group of rows is contiguous."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]  # the sampling policy's log-prob of each completion token
    texts: list[str]
    group_ids: list[int]  # the prompt's index in the round
    truncated: list[bool]  # stopped by max_new_tokens rather than a stop token


class Rollout(NamedTuple):
    """What rounds share: the tokenizer, the reward functions and where to sample."""

    tokenizer: Tokenizer
    rewards: dict[str, Reward]  # dotted path -> function
    weights: tuple[float, ...]
    device: str


# --- the data and the rewards -------------------------------------------------------------


def prompt_batches(train_cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> BatchSource:
    """The prompts of `data.train`: `prompts_per_round / world_size` per rank and round, as
    {"prompt_ids", "records"}, read by the same cursor as every other dataset."""
    per_rank, left = divmod(train_cfg.grpo.prompts_per_round, world_size)
    if left:
        raise ValueError(
            f"grpo.prompts_per_round ({train_cfg.grpo.prompts_per_round}) must divide among "
            f"{world_size} ranks"
        )
    dataset = open_dataset(train_cfg.data.train, "grpo", tokenizer=train_cfg.tokenizer or None)
    cursor = start_cursor(per_rank, train_cfg.seed, rank, world_size, train_cfg.data.shuffle)
    # a resumed state's cursor says batch_size rows (what the loop gives every source): fix it
    return BatchSource(cursor, lambda c: next_batch(dataset, {**c, "batch_size": per_rank}))


def open_rollout(state: TrainState, train_cfg: TrainConfig) -> Rollout:
    """The tokenizer and the reward functions of the run's rounds."""
    grpo = train_cfg.grpo
    rewards = {path: load_reward(path, "grpo.rewards") for path in grpo.rewards}
    weights = grpo.reward_weights or (1.0,) * len(grpo.rewards)
    return Rollout(
        run_tokenizer(train_cfg, "grpo rollouts"), rewards, tuple(weights), str(state.device)
    )


# --- one round as functions ---------------------------------------------------------------


def request_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of completion `index` in the round that starts at `step`: a pure
    function of the three, so a resumed run samples exactly what the straight run did."""
    return int(np.random.SeedSequence([seed, step, index]).generate_state(1, np.uint64)[0] >> 1)


def sample_group(
    params: dict,
    cfg: ModelConfig,
    tokenizer: Tokenizer,
    prompt_ids: list[list[int]],
    grpo: GrpoConfig,
    seeds: list[int],
    device: str = "cpu",
) -> Samples:
    """`group_size` completions of every prompt, one seeded request each, in one continuous
    batch on a fresh engine: a pure function of the weights, prompts and seeds (no thread, no
    prefix cache carried over from older weights), so a resumed run samples exactly what the
    straight run did. The requests of a group share their prompt's pages."""
    G = grpo.group_size
    rows = [p for p in prompt_ids for _ in range(G)]
    sampling = dict(
        max_tokens=grpo.max_new_tokens,
        temperature=grpo.temperature,
        top_p=grpo.top_p,
        top_k=grpo.top_k,
        logprobs=True,
    )
    # a pool sized to the round, not to the model's longest context
    longest = min(max(map(len, rows)) + grpo.max_new_tokens, cfg.max_position_embeddings)
    engine = init_engine(
        params,
        cfg,
        tokenizer,
        max_batch=len(rows),
        max_seq_len=longest,
        device=device,
        speculative=grpo.speculative,
        draft_model=grpo.draft_model,
        speculative_k=grpo.speculative_k,
    )
    requests = [
        Request(str(i), p, sampling_params(seed=s, **sampling))
        for i, (p, s) in enumerate(zip(rows, seeds))
    ]
    with torch.inference_mode():  # no autograd records; the pool and copies die here
        _, done = run_requests(
            engine, prepare_params(params_for(engine.engine_config, params)), requests
        )
    for c in done:
        if c.finish_reason == "error":
            raise RuntimeError(f"a rollout failed in the inference core: {c.error}")
    return Samples(
        prompt_ids=rows,
        completion_ids=[c.token_ids for c in done],
        logprobs=[[lp.logprob for lp in c.logprobs] for c in done],
        texts=[c.text for c in done],
        group_ids=[i // G for i in range(len(rows))],
        truncated=[c.finish_reason == "length" for c in done],
    )


def score(
    rewards: dict[str, Reward], prompts: list[str], completions: list[str], fields: dict
) -> dict[str, list[float]]:
    """Each reward function's rewards for every completion, by its name."""
    return {
        name: call_reward(name, fn, prompts, completions, fields) for name, fn in rewards.items()
    }


def total_reward(rewards: dict[str, list[float]], weights: tuple[float, ...]) -> torch.Tensor:
    """The weighted sum over reward functions, per completion [N]."""
    per_fn = torch.tensor(list(rewards.values()), dtype=torch.float64)
    return (torch.tensor(weights, dtype=torch.float64)[:, None] * per_fn).sum(0).float()


def build_batch(samples: Samples, rewards: torch.Tensor, scale: bool, pad_id: int = 0) -> dict:
    """The loss's batch: prompt + completion right-padded to one length, labels on the
    completion tokens only, the sampling log-probs as `old_logps` at the same positions, and
    advantages normalised within each prompt's group."""
    lengths = [len(p) + len(c) for p, c in zip(samples.prompt_ids, samples.completion_ids)]
    shape = (len(lengths), max(lengths))
    ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE, dtype=torch.long)
    old = torch.zeros(shape)
    for b, (p, c, lp) in enumerate(
        zip(samples.prompt_ids, samples.completion_ids, samples.logprobs)
    ):
        ids[b, : lengths[b]] = torch.tensor(p + c)
        at = slice(len(p) - 1, len(p) - 1 + len(c))  # position t predicts token t + 1
        labels[b, at] = torch.tensor(c)
        old[b, at] = torch.tensor(lp)
    group_ids = torch.tensor(samples.group_ids)
    advantages = group_advantages(rewards, group_ids, scale)
    return {"input_ids": ids, "labels": labels, "old_logps": old, "advantages": advantages}


def step_batches(batch: dict, rows_per_step: int, epochs: int, seed: int, step: int) -> list:
    """The round's optimizer steps: each epoch the rows in an order drawn from (seed, step,
    epoch), cut into `rows_per_step` rows per step."""
    n = batch["input_ids"].shape[0]
    parts = []
    for epoch in range(epochs):
        order = torch.from_numpy(np.random.default_rng([seed, step, epoch]).permutation(n))
        parts += [{k: v[rows] for k, v in batch.items()} for rows in order.split(rows_per_step)]
    return parts


# --- the round in the loop ----------------------------------------------------------------


def sample_and_score(state: TrainState, prompts: dict, run: Run, rollout: Rollout):
    """Sample the round with the state's params and score it -> (samples, rewards by name)."""
    cfg, dist = run.train_cfg, run.dist
    first = dist.rank * len(prompts["prompt_ids"]) * cfg.grpo.group_size
    count = len(prompts["prompt_ids"]) * cfg.grpo.group_size
    seeds = [request_seed(cfg.seed, state.step, first + i) for i in range(count)]
    samples = sample_group(
        model_params(state),
        state.model_config,
        rollout.tokenizer,
        prompts["prompt_ids"],
        cfg.grpo,
        seeds,
        rollout.device,
    )
    prompt_texts = [
        rollout.tokenizer.decode(p, skip_special_tokens=False)
        for p in prompts["prompt_ids"]
        for _ in range(cfg.grpo.group_size)
    ]
    fields = record_fields(prompts["records"], cfg.grpo.group_size)
    return samples, score(rollout.rewards, prompt_texts, samples.texts, fields)


def round_advance(run: Run, rollout: Rollout):
    """A batch of prompts: one round (the loop's way to advance on a prompt dataset)."""

    def advance(state: TrainState, cursor, prompts: dict) -> TrainState:
        return train_round(state, cursor, prompts, run, rollout)

    return advance


def train_round(state: TrainState, cursor, prompts: dict, run: Run, rollout: Rollout) -> TrainState:
    """One round: sample, score, then `epochs` passes of `run_step` over the completions ->
    the state after them, its cursor past these prompts. The state is donated, as to
    `train_step`.

    Should sampling or a reward fail, no step of the round has been taken: the state from
    before it is saved as a checkpoint (when it is not one already) and the error goes up."""
    cfg, started = run.train_cfg, time.perf_counter()
    try:
        samples, rewards = sample_and_score(state, prompts, run, rollout)
    except Exception:
        ensure_checkpoint(state, run)
        raise
    rollout_s = time.perf_counter() - started
    total = total_reward(rewards, rollout.weights)
    pad = rollout.tokenizer.pad_id or 0
    batch = build_batch(samples, total, cfg.loss.grpo_scale_rewards, pad)
    rows = rows_per_rank(cfg, run.dist.world_size)
    first, state, steps = state.step, state._replace(cursor=cursor), []
    for part in step_batches(batch, rows, cfg.grpo.epochs, cfg.seed, first):
        if state.step >= cfg.max_steps:
            break
        state, metrics = run_step(state, part, run)
        steps.append(metrics)
    times = (rollout_s, time.perf_counter() - started - rollout_s)
    record = round_metrics(state.step, samples, rewards, total, steps, times)
    if run.dist.is_main:
        append_metrics(run.run_dir / "metrics.jsonl", record)
        if cfg.progress:
            show_progress(round_line(record, first), run.log, final=True)
    return state


def ensure_checkpoint(state: TrainState, run: Run) -> None:
    """Save the state as a checkpoint (it is consistent: between rounds) unless one of its step
    exists already."""
    if state.step and not checkpoint_path(run.run_dir, state.step).exists():
        save_checkpoint(state, run)


def round_metrics(step, samples: Samples, rewards: dict, total, steps: list, times) -> dict:
    """The round's record for metrics.jsonl; rewards and lengths over all ranks."""
    lengths = [len(c) for c in samples.completion_ids]
    columns = [total.tolist(), *rewards.values()]
    moments = [m for v in columns for m in (sum(v), sum(x * x for x in v))]
    values = [len(lengths), sum(lengths), sum(samples.truncated), *moments]
    stats = torch.tensor(values, dtype=torch.float64)
    all_reduce_sum_([stats])
    n, tokens, truncated, *moments = stats.tolist()
    names = ["", *(f"/{short_name(k, rewards)}" for k in rewards)]
    record = {"step": step}
    for name, (s, sq) in zip(names, zip(moments[::2], moments[1::2])):
        mean = s / n
        record[f"reward_mean{name}"] = mean
        record[f"reward_std{name}"] = math.sqrt(max(sq / n - mean * mean, 0.0))
    for key in ("kl", "clip_fraction"):
        if steps and key in steps[0]:
            record[f"{key}_mean"] = sum(m[key] for m in steps) / len(steps)
    rollout_s, train_s = times
    record |= {
        "completion_len_mean": tokens / n,
        "truncated": truncated / n,
        "rollout_tokens_per_s": tokens / max(rollout_s, 1e-9),
        "rollout_s": rollout_s,
        "train_s": train_s,
    }
    return record


def short_name(path: str, rewards: dict) -> str:
    """A reward's metric name: its function name, or the whole path when that is ambiguous."""
    name = path.rsplit(".", 1)[-1]
    return path if sum(p.rsplit(".", 1)[-1] == name for p in rewards) > 1 else name


def round_line(record: dict, first: int) -> str:
    per_fn = ", ".join(
        f"{k.split('/', 1)[1]} {v:.3f}" for k, v in record.items() if k.startswith("reward_mean/")
    )
    return (
        f"grpo steps {first + 1}-{record['step']}: reward {record['reward_mean']:.3f} ± {record['reward_std']:.3f}"
        f" ({per_fn}), {record['completion_len_mean']:.1f} tokens per completion, rollout "
        f"{record['rollout_s']:.1f}s ({record['rollout_tokens_per_s']:,.0f} tok/s), train "
        f"{record['train_s']:.1f}s"
    )
