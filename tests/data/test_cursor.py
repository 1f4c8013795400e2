"""Batches as a function of the cursor: resuming is exact, ranks split an epoch disjointly."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from astrai.data import Cursor, data_config, next_batch, next_indices, open_dataset, prepare


def walk(n: int, cursor, steps: int) -> tuple[object, list[int]]:
    seen = []
    for _ in range(steps):
        cursor, indices = next_indices(n, cursor)
        seen += indices.tolist()
    return cursor, seen


@given(
    st.integers(1, 60), st.integers(1, 9), st.integers(0, 40), st.integers(0, 40), st.integers(0, 5)
)
def test_resuming_from_a_saved_cursor_continues_exactly(n, batch_size, first, second, seed):
    cursor = Cursor(batch_size=batch_size, seed=seed)
    _, straight = walk(n, cursor, first + second)
    saved, head = walk(n, cursor, first)
    restored = msgspec.json.decode(msgspec.json.encode(saved), type=Cursor)
    _, tail = walk(n, restored, second)
    assert head + tail == straight


@given(st.integers(1, 50), st.integers(1, 8), st.integers(0, 3))
def test_every_epoch_visits_every_example_once(n, batch_size, seed):
    cursor = Cursor(batch_size=batch_size, seed=seed)
    seen = []
    while cursor.epoch < 2:
        cursor, indices = next_indices(n, cursor)
        seen += indices.tolist()
    # every batch is full, so a batch may run into epoch 2; the first 2n are two epochs
    assert sorted(seen[:n]) == list(range(n)) == sorted(seen[n : 2 * n])
    assert len(seen) % batch_size == 0


@given(st.integers(1, 30), st.integers(1, 4), st.integers(1, 6), st.integers(0, 3))
def test_ranks_read_disjoint_slices_whose_union_is_the_epoch(
    per_rank, world_size, batch_size, seed
):
    n = per_rank * world_size
    single = Cursor(batch_size=1, seed=seed)
    _, epoch = walk(n, single, n)
    slices = []
    for rank in range(world_size):
        cursor = Cursor(batch_size=batch_size, seed=seed, rank=rank, world_size=world_size)
        steps = -(-per_rank // batch_size)
        _, seen = walk(n, cursor, steps)
        slices.append(seen[:per_rank])  # beyond that, the next epoch has begun
    union = [i for s in slices for i in s]
    assert sorted(union) == sorted(epoch) == list(range(n))
    assert len(set(union)) == n  # disjoint


def test_ranks_leave_out_the_remainder_and_take_equal_steps():
    # 10 examples over 3 ranks: 3 each, one left out this epoch; one batch of 3 ends the epoch
    seen = []
    for rank in range(3):
        cursor, indices = next_indices(10, Cursor(batch_size=3, rank=rank, world_size=3))
        assert (cursor.epoch, cursor.position) == (1, 0)
        seen += indices.tolist()
    assert len(set(seen)) == 9


def test_shuffling_depends_on_seed_and_epoch_only():
    first = next_indices(100, Cursor(batch_size=100, seed=1))[1]
    again = next_indices(100, Cursor(batch_size=100, seed=1))[1]
    other_seed = next_indices(100, Cursor(batch_size=100, seed=2))[1]
    next_epoch = next_indices(100, Cursor(batch_size=100, seed=1, epoch=1))[1]
    in_order = next_indices(100, Cursor(batch_size=100, shuffle=False))[1]
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other_seed) and not np.array_equal(first, next_epoch)
    assert in_order.tolist() == list(range(100))


def test_bad_cursors_are_refused():
    with pytest.raises(ValueError, match="rank"):
        Cursor(batch_size=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="cannot be shared"):
        next_indices(1, Cursor(batch_size=2, rank=0, world_size=2))


def test_next_batch_resumes_from_a_json_cursor(tok_dir, tmp_path, write_jsonl, chat):
    write_jsonl(tmp_path / "a.jsonl", [chat(i, turns=1 + i % 2) for i in range(30)])
    cfg = data_config(
        {
            "tokenizer": str(tok_dir),
            "inputs": [str(tmp_path / "a.jsonl")],
            "output": str(tmp_path / "out"),
            "kind": "sft",
            "max_seq_len": 96,
            "packing": "bfd",
            "positions": "document",
            "progress": False,
        }
    )
    prepare(cfg, log=None)
    data = open_dataset(cfg.output)
    cursor = {"batch_size": 4, "seed": 7, "epoch": 0, "position": 0, "rank": 0, "world_size": 1}
    straight, c = [], cursor
    for _ in range(7):
        c, batch = next_batch(data, c)
        straight.append(batch)
    c = cursor
    for _ in range(3):
        c, _ = next_batch(data, c)
    c = json.loads(json.dumps(c))  # the cursor as a checkpoint stores it
    resumed = []
    for _ in range(4):
        c, batch = next_batch(data, c)
        resumed.append(batch)
    for a, b in zip(straight[3:], resumed):
        assert a.keys() == b.keys() == {"input_ids", "labels", "positions", "doc_ids"}
        assert all(torch.equal(a[k], b[k]) for k in a)
    batch = straight[0]
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 96)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    # labels are the inputs shifted left by one, where trained
    trained = batch["labels"][:, :-1] != -100
    assert torch.equal(batch["labels"][:, :-1][trained], batch["input_ids"][:, 1:][trained])
    assert (batch["labels"][:, -1] == -100).all()
