"""`prepare`: JSONL records to token shards, driven by a `DataConfig`.

read lines -> parse, render, filter, tokenise (examples.py) -> fit to max_seq_len (truncate,
split or drop) -> group into shards -> pack each shard's documents into rows -> write.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import msgspec
import numpy as np

from astrai.config import ConfigError
from astrai.data.config import DataConfig
from astrai.data.examples import Example, Skip, tokenised_examples
from astrai.data.packing import PACKERS, fit_length, offsets, segment_positions
from astrai.data.progress import human, progress_printer
from astrai.data.records import RecordError, expand_inputs, read_lines
from astrai.data.shards import FORMAT, VERSION, staged_output, write_index, write_shard

# How many bad records are printed one by one before only counting them.
SHOWN_ERRORS = 20

Doc = tuple[dict[str, tuple[np.ndarray, np.ndarray]], str]  # columns (ids, mask), record JSON


class Summary(msgspec.Struct, frozen=True):
    """What a run read, kept, dropped (by reason) and wrote."""

    records_read: int
    records_kept: int
    dropped: dict[str, int]
    truncated: int
    split: int
    rows: int
    tokens: int
    trained_tokens: int
    shards: int
    bytes_read: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class Tally:
    """Running counts of one run (host-side bookkeeping, updated as records stream by)."""

    total_bytes: int = 0
    bytes_read: int = 0
    records_read: int = 0
    records_kept: int = 0
    dropped: Counter = dataclasses.field(default_factory=Counter)
    truncated: int = 0
    split: int = 0
    rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    shards: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)

    def summary(self) -> Summary:
        return Summary(
            self.records_read, self.records_kept, dict(sorted(self.dropped.items())), self.truncated,
            self.split, self.rows, self.tokens, self.trained_tokens, self.shards, self.bytes_read,
            time.monotonic() - self.started,
        )  # fmt: skip


def load_tokenizer(path: str) -> Any:
    from astrai.tokenizer import Tokenizer  # imported late: the pipeline needs it only here

    return Tokenizer.from_pretrained(path)


def tokenizer_hash(path: str) -> str | None:
    """SHA-256 of the folder's tokenizer.json; None for a tokenizer that was given, not named."""
    file = Path(path) / "tokenizer.json"
    return hashlib.sha256(file.read_bytes()).hexdigest() if path and file.is_file() else None


def prepare(cfg: DataConfig, tokenizer: Any = None, log: TextIO | str | None = "stderr") -> Summary:
    """Write the shards and index of `cfg` into `cfg.output`, replacing what was there only
    once everything is written. Bad records are reported on `log` (with `cfg.strict` the first
    one raises `RecordError`); the summary is printed at the end and returned. `log` is a
    stream, "stderr" (sys.stderr at call time) or None (silent)."""
    log = sys.stderr if log == "stderr" else log
    if not cfg.output:
        raise ConfigError("output: the folder to write the shards into must be given")
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
    files = expand_inputs(cfg.inputs)
    tally = Tally(total_bytes=sum(Path(f).stat().st_size for f in files))
    with staged_output(cfg.output) as stage:
        entries = []
        for number, shard in enumerate(build_shards(cfg, tok, files, tally, log)):
            entry = write_shard(stage, number, shard)
            entries.append({**entry, **shard_counts(shard)})
        summary = tally.summary()
        write_index(stage, make_index(cfg, tok, entries, summary))
    if log is not None:
        log.write(format_summary(summary) + "\n")
    return summary


def build_shards(
    cfg: DataConfig, tok: Any, files: list[str], tally: Tally, log: TextIO | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """The shards of `cfg` as dicts of arrays, each about `cfg.shard_tokens` tokens."""
    token_dtype = token_dtype_for(tok.vocab_size)
    buffer: list[Doc] = []
    buffered = 0
    for doc in fitted_docs(cfg, tok, files, tally, log):
        n = max(len(ids) for ids, _ in doc[0].values())
        if buffer and buffered + n > cfg.shard_tokens:
            yield make_shard(cfg, buffer, token_dtype, tally)
            buffer, buffered = [], 0
        buffer.append(doc)
        buffered += n
    if buffer:
        yield make_shard(cfg, buffer, token_dtype, tally)


def fitted_docs(
    cfg: DataConfig, tok: Any, files: list[str], tally: Tally, log: TextIO | None
) -> Iterator[Doc]:
    """Documents that fit `max_seq_len`, counting what is read, kept, dropped and why."""
    show = progress_printer(log) if cfg.progress and log is not None else None
    for results, size in tokenised_examples(cfg, tok, read_lines(files)):
        tally.bytes_read += size
        for result in results:
            if cfg.max_items is not None and tally.records_kept >= cfg.max_items:
                return
            tally.records_read += 1
            docs = fit_example(cfg, result, tally) if isinstance(result, Example) else []
            if isinstance(result, Skip):
                report_skip(cfg, result, tally, log)
            if docs:
                tally.records_kept += 1
                for columns, _ in docs:
                    tally.tokens += sum(len(ids) for ids, _ in columns.values())
                    tally.trained_tokens += sum(int(mask.sum()) for _, mask in columns.values())
                yield from docs
        if show is not None:
            show(tally.bytes_read, tally.total_bytes, tally.records_read, tally.tokens)
    if show is not None:
        show(tally.bytes_read, tally.total_bytes, tally.records_read, tally.tokens, final=True)


def report_skip(cfg: DataConfig, skip: Skip, tally: Tally, log: TextIO | None) -> None:
    tally.dropped[skip.reason] += 1
    is_error = skip.reason in ("invalid_json", "missing_field", "wrong_type")
    if is_error and cfg.strict:
        raise RecordError(skip.source, skip.reason, skip.message)
    bad = sum(tally.dropped[r] for r in ("invalid_json", "missing_field", "wrong_type"))
    if is_error and log is not None and bad <= SHOWN_ERRORS:
        more = " (further bad records are only counted)" if bad == SHOWN_ERRORS else ""
        log.write(f"{skip.source}: skipped: {skip.reason}: {skip.message}{more}\n")


def fit_example(cfg: DataConfig, example: Example, tally: Tally) -> list[Doc]:
    """The documents one record becomes: itself, truncated, split into pieces, or none."""
    if cfg.kind == "seq" and cfg.packing == "none":
        return [(example.columns, example.record)]  # a token stream read in windows: any length
    pieces = {
        name: fit_length(ids, mask, cfg.max_seq_len, cfg.too_long, cfg.truncate_side)
        for name, (ids, mask) in example.columns.items()
    }
    if any(not p for p in pieces.values()):
        tally.dropped["too_long"] += 1
        return []
    lengths = {name: len(ids) for name, (ids, _) in example.columns.items()}
    if len(next(iter(pieces.values()))) > 1:
        tally.split += 1
    elif any(len(p[0][0]) < lengths[name] for name, p in pieces.items()):
        tally.truncated += 1
    # pieces without a trained token would cost compute and teach nothing (grpo has no targets)
    if len(pieces) == 1:
        name, parts = next(iter(pieces.items()))
        docs = [({name: p}, example.record) for p in parts if cfg.kind == "grpo" or p[1].any()]
    else:
        columns = {name: parts[0] for name, parts in pieces.items()}
        docs = [(columns, example.record)] if all(m.any() for _, m in columns.values()) else []
    if not docs:
        tally.dropped["nothing_to_train"] += 1
    return docs


def make_shard(
    cfg: DataConfig, docs: list[Doc], token_dtype: np.dtype, tally: Tally
) -> dict[str, np.ndarray]:
    """Pack documents into rows and lay each column out as flat arrays plus offsets."""
    names = list(docs[0][0])
    packer = PACKERS[cfg.packing if len(names) == 1 else "none"]
    rows = packer([len(d[0][names[0]][0]) for d in docs], cfg.max_seq_len)
    order = [i for row in rows for i in row]
    arrays: dict[str, np.ndarray] = {}
    for name in names:
        ids = [docs[i][0][name][0] for i in order]
        masks = [docs[i][0][name][1] for i in order]
        doc_lengths = np.array([len(x) for x in ids], dtype=np.int64)
        row_lengths = np.array(
            [sum(len(docs[i][0][name][0]) for i in row) for row in rows], np.int64
        )
        flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        if flat.size and int(flat.max()) > np.iinfo(token_dtype).max:
            raise ValueError(f"token id {int(flat.max())} does not fit {token_dtype}")
        arrays[f"{name}.ids"] = flat.astype(token_dtype)
        arrays[f"{name}.mask"] = np.concatenate(masks).astype(np.uint8)
        arrays[f"{name}.rows"] = offsets(row_lengths)
        arrays[f"{name}.docs"] = offsets(doc_lengths)
        if cfg.positions != "none":
            lengths = doc_lengths if cfg.positions == "document" else row_lengths
            positions = segment_positions(lengths)
            arrays[f"{name}.positions"] = positions.astype(
                token_dtype_for(int(positions.max()) + 1)
            )
    if cfg.kind == "grpo":
        records = [docs[i][1].encode() for i in order]
        arrays["records.data"] = np.frombuffer(b"".join(records), dtype=np.uint8)
        arrays["records.offsets"] = offsets([len(r) for r in records])
    tally.rows += len(rows)
    tally.shards += 1
    return arrays


def shard_counts(shard: dict[str, np.ndarray]) -> dict[str, int]:
    ids = [k for k in shard if k.endswith(".ids")]
    first = ids[0].removesuffix(".ids")
    return {"rows": len(shard[f"{first}.rows"]) - 1, "tokens": sum(len(shard[k]) for k in ids)}


def token_dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def make_index(
    cfg: DataConfig, tok: Any, entries: list[dict[str, Any]], summary: Summary
) -> dict[str, Any]:
    """Everything a reader needs besides the arrays, and what produced them."""
    pad = tok.pad_id if tok.pad_id is not None else tok.eos_id
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": cfg.kind,
        "columns": {"dpo": ["chosen", "rejected"], "grpo": ["prompt"]}.get(cfg.kind, ["tokens"]),
        "max_seq_len": cfg.max_seq_len,
        "packing": cfg.packing,
        "positions": cfg.positions,
        "windows": cfg.kind == "seq" and cfg.packing == "none",
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "pad_id": pad if pad is not None else 0,
        "tokenizer": {"path": cfg.tokenizer, "sha256": tokenizer_hash(cfg.tokenizer)},
        "counts": msgspec.to_builtins(summary),
        "shards": entries,
        "config": msgspec.to_builtins(cfg),
    }


def format_summary(s: Summary) -> str:
    dropped = ", ".join(f"{k} {v:,}" for k, v in s.dropped.items()) or "none"
    return (
        f"records read {s.records_read:,}, kept {s.records_kept:,}, dropped: {dropped}; "
        f"truncated {s.truncated:,}, split {s.split:,}\n"
        f"wrote {s.tokens:,} tokens ({s.trained_tokens:,} trained) in {s.rows:,} rows, "
        f"{s.shards} shards; {s.seconds:.1f} s, {human(s.tokens_per_second)} tokens/s, "
        f"{s.bytes_read / 1e6 / max(s.seconds, 1e-9):.1f} MB/s"
    )
