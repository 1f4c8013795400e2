"""Where training batches come from: `source.next(cursor) -> (cursor, batch)`.

"shards" reads folders prepared by `just prepare` (or a data TOML / JSONL file, tokenised in
memory) through astrai.data; "synthetic" makes small
learnable toy batches for every kind (counting sequences modulo the vocabulary), for smoke
tests and benchmarks. Each rank reads only its own rows of every global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from astrai.config import ModelConfig, TrainConfig
from astrai.data import IGNORE, Cursor, as_cursor, cursor_dict, next_batch, open_dataset
from astrai.train.losses import shifted_labels, with_advantages

GRPO_GROUP = 4  # completions per prompt in synthetic grpo batches


class BatchSource(NamedTuple):
    cursor: dict  # where reading starts: JSON-able, stored in the train state
    next: Callable[[dict], tuple[dict, dict]]


def start_cursor(rows: int, seed: int, rank: int, world_size: int, shuffle: bool) -> dict:
    """A data `Cursor` at the start of epoch 0, in the JSON-able form the train state keeps."""
    cursor = Cursor(batch_size=rows, seed=seed, rank=rank, world_size=world_size, shuffle=shuffle)
    return cursor_dict(cursor)


def rows_per_rank(train_cfg: TrainConfig, world_size: int) -> int:
    rows, left = divmod(train_cfg.batch_size, world_size)
    if left or rows % train_cfg.grad_accum:
        raise ValueError(
            f"batch_size ({train_cfg.batch_size}) must split evenly into {world_size} ranks "
            f"x grad_accum ({train_cfg.grad_accum}) micro-batches"
        )
    return rows


def open_batches(
    train_cfg: TrainConfig,
    model_cfg: ModelConfig,
    rank: int = 0,
    world_size: int = 1,
    split: str = "train",
) -> BatchSource | None:
    """The batches of `split` ("train" or "valid") for this rank; None when there are none."""
    data = train_cfg.data
    rows = rows_per_rank(train_cfg, world_size)
    seed = train_cfg.seed if split == "train" else train_cfg.seed + 1_000_003
    cursor = start_cursor(rows, seed, rank, world_size, data.shuffle and split == "train")
    if data.source == "synthetic":
        return BatchSource(cursor, lambda c: next_synthetic(c, train_cfg, model_cfg))
    path = data.train if split == "train" else data.valid
    if not path:
        return None
    if train_cfg.kind == "grpo":
        raise ValueError(
            "grpo trains on prepared rollouts passed to train(..., batches=...) or on "
            "source = 'synthetic'; a prompt folder alone has no completions to learn from"
        )
    # A prepared folder is memory-mapped; a data TOML or JSONL file is tokenised in memory.
    dataset = open_dataset(path, train_cfg.kind, tokenizer=train_cfg.tokenizer or None)
    return BatchSource(cursor, lambda c: next_batch(dataset, c))


def with_rank(cursor: dict, rank: int, world_size: int, rows: int) -> dict:
    """A saved cursor (rank 0's) for this rank: all ranks stand at the same position."""
    return {**cursor, "rank": rank, "world_size": world_size, "batch_size": rows}


# --- synthetic batches ----------------------------------------------------------------------


def next_synthetic(cursor: dict, train_cfg: TrainConfig, cfg: ModelConfig) -> tuple[dict, dict]:
    """The next synthetic batch: `position` counts rows of the global stream, never wrapping."""
    c = as_cursor(cursor)
    global_rows = c.batch_size * c.world_size
    seq_len, vocab = train_cfg.data.seq_len, cfg.vocab_size
    index = c.position // global_rows
    whole = synthetic_batch(train_cfg.kind, c.seed, index, global_rows, seq_len, vocab)
    whole = with_advantages(whole, train_cfg.loss)  # grpo: over whole groups, before slicing
    mine = {k: v[c.rank * c.batch_size : (c.rank + 1) * c.batch_size] for k, v in whole.items()}
    return {**cursor, "position": c.position + global_rows}, mine


def _counting(g: torch.Generator, n: int, length: int, vocab: int) -> torch.Tensor:
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return (start + stride * torch.arange(length)) % vocab


def synthetic_batch(
    kind: str, seed: int, index: int, rows: int, seq_len: int, vocab: int
) -> dict[str, torch.Tensor]:
    """Global batch number `index`: a pure function of its arguments, so any rank (and any
    resumed run) makes the same rows. Continuing a counting sequence is the learnable task."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    half = seq_len // 2
    if kind in ("seq", "sft"):
        ids = _counting(g, rows, seq_len, vocab)
        labels = shifted_labels(ids)
        if kind == "sft":
            labels[:, : half - 1] = IGNORE  # the "prompt" half is not trained
        return {"input_ids": ids, "labels": labels}
    if kind == "dpo":
        chosen = _counting(g, rows, seq_len, vocab)
        rejected = chosen.clone()
        rejected[:, half:] = torch.randint(0, vocab, (rows, seq_len - half), generator=g)
        out = {"chosen_ids": chosen, "rejected_ids": rejected}
        for name, ids in (("chosen", chosen), ("rejected", rejected)):
            labels = shifted_labels(ids)
            labels[:, : half - 1] = IGNORE
            out[f"{name}_labels"] = labels
        return out
    if kind == "grpo":
        if rows % GRPO_GROUP:
            raise ValueError(f"synthetic grpo needs batch rows in multiples of {GRPO_GROUP}")
        prompts = _counting(g, rows // GRPO_GROUP, seq_len, vocab).repeat_interleave(GRPO_GROUP, 0)
        noise = torch.randint(0, vocab, (rows, seq_len - half), generator=g)
        wrong = torch.rand(rows, 1, generator=g) < 0.5  # a completion is all right or all noise
        ids = prompts.clone()
        ids[:, half:] = torch.where(wrong, noise, prompts[:, half:])
        labels = shifted_labels(ids)
        labels[:, : half - 1] = IGNORE
        batch = {
            "input_ids": ids,
            "labels": labels,
            "rewards": (ids[:, half:] == prompts[:, half:]).float().mean(-1),
            "group_ids": torch.arange(rows) // GRPO_GROUP,
        }
        return batch
    raise ValueError(f"unknown kind {kind!r}")
