"""Lines of JSONL to tokenised examples: token ids and a loss mask per column.

Tokenising is batched through `tokenizers` (one `encode_batch` call per batch of records) and,
with `workers > 1`, spread over processes. Results come back in input order either way, so the
output does not depend on the number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from astrai.data.config import DataConfig
from astrai.data.records import (
    Columns,
    RecordError,
    column_chars,
    parse_record,
    render_record,
)


class Example(NamedTuple):
    """One usable record: per column (ids int64 [n], mask uint8 [n]); the record as JSON."""

    source: str
    columns: dict[str, tuple[np.ndarray, np.ndarray]]
    record: str


class Skip(NamedTuple):
    """A record left out, and why: a `RecordError` reason or a filter's name."""

    source: str
    reason: str
    message: str


def section_mask(roles: list[str], loss_sections: str | tuple[str, ...]) -> list[bool]:
    """Which sections are trained on: every one, those of the given roles, or the last
    assistant turn (the last run of consecutive assistant sections)."""
    if loss_sections == "all":
        return [True] * len(roles)
    if loss_sections == "last_assistant":
        mask = [False] * len(roles)
        i = len(roles) - 1
        while i >= 0 and roles[i] != "assistant":
            i -= 1
        while i >= 0 and roles[i] == "assistant":
            mask[i] = True
            i -= 1
        return mask
    return [role in loss_sections for role in roles]


def encode_columns(
    tok: Any, cfg: DataConfig, rendered: list[Columns]
) -> list[dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Tokenise the text sections of many records with one batch call; ids and masks per column."""
    texts = [
        p
        for cols in rendered
        for sections in cols.values()
        for p, _ in sections
        if isinstance(p, str)
    ]
    encoded = iter(tok.encode_batch(texts) if texts else [])
    out = []
    for cols in rendered:
        columns = {}
        for name, sections in cols.items():
            trained = section_mask([role for _, role in sections], cfg.loss_sections)
            pieces = [[p] if isinstance(p, int) else next(encoded) for p, _ in sections]
            ids = np.fromiter((t for piece in pieces for t in piece), dtype=np.int64)
            mask = np.repeat(np.array(trained, dtype=np.uint8), [len(p) for p in pieces])
            columns[name] = (ids, mask)
        out.append(columns)
    return out


def examples_from_lines(
    cfg: DataConfig, tok: Any, lines: list[tuple[str, bytes]]
) -> list[Example | Skip]:
    """Parse, render, filter by characters and tokenise one batch of lines, in order."""
    results: list[Example | Skip | None] = []
    keep: list[tuple[int, str, Columns, str]] = []
    for source, line in lines:
        try:
            record = parse_record(source, line)
            columns = render_record(cfg, tok, record, source)
        except RecordError as exc:
            results.append(Skip(source, exc.reason, exc.message))
            continue
        chars = column_chars(columns)
        if chars == 0:
            results.append(Skip(source, "empty", "no text"))
        elif chars < cfg.min_chars:
            results.append(Skip(source, "too_short", f"{chars} characters"))
        elif cfg.max_chars is not None and chars > cfg.max_chars:
            results.append(Skip(source, "too_many_chars", f"{chars} characters"))
        else:
            # only grpo hands records on (to reward functions); the others need just tokens
            record = line.decode("utf-8").strip() if cfg.kind == "grpo" else ""
            keep.append((len(results), source, columns, record))
            results.append(None)
    encoded = encode_columns(tok, cfg, [cols for _, _, cols, _ in keep])
    for (i, source, _, record), columns in zip(keep, encoded):
        results[i] = Example(source, columns, record)
    return results  # type: ignore[return-value]


def batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenised_examples(
    cfg: DataConfig, tok: Any, lines: Iterable[tuple[str, bytes]]
) -> Iterator[tuple[list[Example | Skip], int]]:
    """(results, bytes read) per batch of `cfg.batch_records` lines, in input order."""
    batches = (
        (batch, sum(len(line) for _, line in batch)) for batch in batched(lines, cfg.batch_records)
    )
    if cfg.workers == 1:
        for batch, size in batches:
            yield examples_from_lines(cfg, tok, batch), size
        return
    ctx = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    )
    with ctx.Pool(cfg.workers, initializer=_start_worker, initargs=(cfg, tok)) as pool:
        # results are taken in submission order; at most two batches per worker are in flight,
        # so memory stays bounded however large the input (Pool.imap would read it all ahead)
        pending: deque = deque()
        for job in batches:
            pending.append(pool.apply_async(_work, (job,)))
            if len(pending) >= 2 * cfg.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


_worker: dict[str, Any] = {}


def _start_worker(cfg: DataConfig, tok: Any) -> None:
    # each process tokenises one batch at a time; tokenizers' own threads would only contend
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(cfg=cfg, tok=tok)


def _work(job: tuple[list[tuple[str, bytes]], int]) -> tuple[list[Example | Skip], int]:
    batch, size = job
    return examples_from_lines(_worker["cfg"], _worker["tok"], batch), size
