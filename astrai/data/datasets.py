"""Datasets: prepared shards opened as memory maps (or JSONL tokenised on the spot), and the
examples they hold as model-ready numpy arrays.

An example of a seq/sft dataset is one row (or, for a `seq` stream, one window of
`max_seq_len` tokens taken every `stride` tokens) with its labels already shifted:
`labels[t]` is the token to predict at position t, -100 where nothing is trained.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from astrai.data.config import DataConfig, data_config, load_data_config
from astrai.data.pipeline import Tally, build_shards, load_tokenizer, make_index, shard_counts
from astrai.data.records import expand_inputs
from astrai.data.shards import INDEX, ShardError, open_shard, read_index
from astrai.model.logprobs import IGNORE


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """The index (as in index.json) and the arrays of every shard; `starts[k]` is the number
    of examples before shard k."""

    index: dict[str, Any]
    shards: tuple[dict[str, np.ndarray], ...]
    stride: int
    starts: np.ndarray

    @property
    def kind(self) -> str:
        return self.index["kind"]

    @property
    def max_seq_len(self) -> int:
        return self.index["max_seq_len"]

    def __len__(self) -> int:
        return int(self.starts[-1])


def open_dataset(
    source: str | Path,
    kind: str | None = None,
    *,
    tokenizer: Any = None,
    stride: int | None = None,
    **overrides: Any,
) -> Dataset:
    """Open a prepared shard folder, or tokenise a data TOML or JSONL file(s) in memory.

    For a folder, `kind` (if given) must match what was prepared. For a TOML, `kind` and
    `overrides` replace its keys. For JSONL (a path or glob), `tokenizer` (a folder or a loaded
    tokenizer) is required and `kind`/`overrides` are `DataConfig` keys. `stride` spaces the
    windows of a seq stream (default `max_seq_len`: windows that do not overlap).
    """
    source = str(source)
    if Path(source).is_dir():
        index = read_index(source)
        if kind is not None and kind != index["kind"]:
            raise ShardError(f"{source}: holds {index['kind']!r} data, not {kind!r}")
        shards = [open_shard(source, entry) for entry in index["shards"]]
        return make_dataset(index, shards, stride)
    loaded = tokenizer if tokenizer is not None and not isinstance(tokenizer, str) else None
    named = {} if tokenizer is None else {"tokenizer": tokenizer if loaded is None else ""}
    if source.endswith(".toml"):
        cfg = load_data_config(source)
        changes = {**overrides, **named, **({"kind": kind} if kind else {})}
        cfg = data_config({**msgspec.to_builtins(cfg), **changes}, source)
    elif not named:
        raise ValueError(f"{source}: reading JSONL needs a tokenizer (a folder or a Tokenizer)")
    else:
        fields = {"inputs": [source], "kind": kind or "seq", "progress": False, **named}
        cfg = data_config({**fields, **overrides}, "open_dataset")
    tok = loaded if loaded is not None else load_tokenizer(cfg.tokenizer)
    return dataset_in_memory(cfg, tok, stride)


def dataset_in_memory(cfg: DataConfig, tok: Any, stride: int | None = None) -> Dataset:
    """The dataset `prepare(cfg)` would write, built in memory without touching the disk.
    Bad records are reported on stderr (or raise, with `cfg.strict`)."""
    tally = Tally()
    shards = list(build_shards(cfg, tok, expand_inputs(cfg.inputs), tally, sys.stderr))
    entries = [shard_counts(s) for s in shards]
    index = json.loads(json.dumps(make_index(cfg, tok, entries, tally.summary())))
    return make_dataset(index, shards, stride)


def make_dataset(
    index: dict[str, Any], shards: list[dict[str, np.ndarray]], stride: int | None
) -> Dataset:
    stride = stride or index["max_seq_len"]
    if stride <= 0:
        raise ValueError(f"stride must be positive, got {stride}")
    counts = [examples_in(index, shard, stride) for shard in shards]
    return Dataset(
        index, tuple(shards), stride, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    )


def examples_in(index: dict[str, Any], shard: dict[str, np.ndarray], stride: int) -> int:
    column = index["columns"][0]
    if not index["windows"]:
        return len(shard[f"{column}.rows"]) - 1
    n, T = len(shard[f"{column}.ids"]), index["max_seq_len"]
    if n < 2:
        return 0  # nothing to predict
    return (n - T - 1) // stride + 1 if n >= T + 1 else 1


def get_example(data: Dataset, i: int) -> dict[str, Any]:
    """Example `i` (0 <= i < len(data)) as unpadded numpy arrays (a dict; see docs/data.md)."""
    if not 0 <= i < len(data):
        raise IndexError(f"example {i} of a dataset of {len(data)}")
    k = int(np.searchsorted(data.starts, i, side="right")) - 1
    shard, j = data.shards[k], i - int(data.starts[k])
    kind, T = data.kind, data.max_seq_len
    if kind == "grpo":
        start, end = shard["prompt.rows"][j : j + 2]
        lo, hi = shard["records.offsets"][j : j + 2]
        return {
            "prompt_ids": shard["prompt.ids"][start:end].astype(np.int64).tolist(),
            "record": json.loads(shard["records.data"][lo:hi].tobytes()),
        }
    if kind == "dpo":
        out = {}
        for name in ("chosen", "rejected"):
            start, end = shard[f"{name}.rows"][j : j + 2]
            ex = token_example(data.index, shard, name, int(start), int(end), int(end))
            out[f"{name}_ids"], out[f"{name}_labels"] = ex["input_ids"], ex["labels"]
        return out
    if data.index["windows"]:
        start = j * data.stride
        end = min(start + T + 1, len(shard["tokens.ids"]))
        return token_example(data.index, shard, "tokens", start, min(start + T, end), end)
    start, end = shard["tokens.rows"][j : j + 2]
    return token_example(data.index, shard, "tokens", int(start), int(end), int(end))


def token_example(
    index: dict[str, Any],
    shard: dict[str, np.ndarray],
    column: str,
    start: int,
    stop: int,
    end: int,
) -> dict[str, np.ndarray]:
    """Inputs are tokens [start, stop); targets may look one further, up to `end`. Labels stop
    at document boundaries: no position is trained to predict the next document's first token."""
    ids = np.asarray(shard[f"{column}.ids"][start:end], dtype=np.int64)
    trained = np.asarray(shard[f"{column}.mask"][start:end], dtype=bool)
    docs = shard[f"{column}.docs"]
    doc = np.searchsorted(docs, np.arange(start, end), side="right") - 1
    n = stop - start
    labels = np.full(n, IGNORE, dtype=np.int64)
    nxt = np.arange(1, n + 1)
    ok = nxt < len(ids)
    ok[ok] &= trained[nxt[ok]] & (doc[nxt[ok]] == doc[:n][ok])
    labels[ok] = ids[nxt[ok]]
    out = {"input_ids": ids[:n], "labels": labels}
    mode = index["positions"]
    if mode != "none":
        stored = np.asarray(shard[f"{column}.positions"][start:stop], dtype=np.int64)
        if index["windows"]:
            # a window may begin inside a document: count from the window's first token
            same = doc[:n] == doc[0]
            stored = (
                np.where(same, stored - stored[0], stored) if mode == "document" else np.arange(n)
            )
        out["positions"] = stored
    if mode == "document":
        out["doc_ids"] = doc[:n] - doc[0]
    return out


__all__ = ["IGNORE", "INDEX", "Dataset", "get_example", "make_dataset", "open_dataset"]
