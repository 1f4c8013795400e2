"""JSONL records in, sections of text out.

A record becomes one or more *columns* (one for seq/sft, `chosen` and `rejected` for dpo,
`prompt` for grpo). A column is a list of sections `(piece, role)`, where a piece is text to
tokenise or an int token id (bos/eos). The role decides the loss mask later on.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from astrai.data.config import DataConfig

Section = tuple[str | int, str]
Columns = dict[str, list[Section]]


class RecordError(ValueError):
    """A record that cannot be used; names the file and line it came from."""

    def __init__(self, source: str, reason: str, message: str):
        super().__init__(f"{source}: {reason}: {message}")
        self.source, self.reason, self.message = source, reason, message


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files matched by each glob, sorted within a pattern; a pattern matching nothing is an error."""
    files: list[str] = []
    for pattern in patterns:
        matched = (
            sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        )
        matched = [f for f in matched if Path(f).is_file()]
        if not matched:
            raise FileNotFoundError(f"inputs: {pattern!r} matches no file")
        files.extend(f for f in matched if f not in files)
    return files


def read_lines(files: list[str]) -> Iterator[tuple[str, bytes]]:
    """(`file:line`, raw line) for every non-blank line of every file, in order."""
    for path in files:
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield f"{path}:{number}", line


def parse_record(source: str, line: bytes) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(source, "invalid_json", str(exc)) from None
    if not isinstance(record, dict):
        raise RecordError(
            source, "wrong_type", f"a record must be a JSON object, got {_kind(record)}"
        )
    return record


def render_record(cfg: DataConfig, tok: Any, record: dict[str, Any], source: str) -> Columns:
    """The sections of each column of `record`, as `cfg.record_format` says to build them."""
    fields, fmt = cfg.fields, cfg.record_format
    chat = cfg.template == "chat"
    if fmt == "text":
        return {"tokens": _with_specials(cfg, tok, [(_text(record, fields.text, source), "text")])}
    if fmt == "chat":
        messages = _messages(record, fields.messages, source)
        return {"tokens": _chat(tok, messages, _tools(record, fields.tools), source)}
    prompt = _prompt(record, fields.prompt, source)
    if fmt == "prompt":
        # the reference answer (fields.answer) stays in the record for reward functions
        if chat:
            text = tok.apply_chat_template(
                prompt, add_generation_prompt=True, tools=_tools(record, fields.tools)
            )
            return {"prompt": [(text, "prompt")]}
        return {"prompt": [(_plain_prompt(prompt), "prompt")]}
    replies = (
        {"tokens": _text(record, fields.response, source)}
        if fmt == "prompt_response"
        else {
            "chosen": _text(record, fields.chosen, source),
            "rejected": _text(record, fields.rejected, source),
        }
    )
    columns: Columns = {}
    for name, reply in replies.items():
        if chat:
            turns = [*prompt, {"role": "assistant", "content": reply}]
            columns[name] = _chat(tok, turns, _tools(record, fields.tools), source)
        else:
            pieces = [(_plain_prompt(prompt), "user"), (reply, "assistant")]
            columns[name] = _with_specials(cfg, tok, pieces)
    return columns


def column_chars(columns: Columns) -> int:
    """Characters of the longest column's text, what the min/max_chars filters compare."""
    return max(
        sum(len(p) for p, _ in sections if isinstance(p, str)) for sections in columns.values()
    )


def _with_specials(cfg: DataConfig, tok: Any, sections: list[Section]) -> list[Section]:
    # bos is part of the input, never a target; eos belongs to the last section so that it is
    # trained exactly when the text it ends is.
    head = [(tok.bos_id, "template")] if cfg.add_bos and tok.bos_id is not None else []
    tail = [(tok.eos_id, sections[-1][1])] if cfg.add_eos and tok.eos_id is not None else []
    return head + sections + tail


def _chat(tok: Any, messages: list[dict], tools: Any, source: str) -> list[Section]:
    try:
        return list(tok.chat_segments(messages, tools=tools))
    except Exception as exc:  # a template error is a fact about this record
        raise RecordError(source, "wrong_type", f"chat template failed: {exc}") from None


def _plain_prompt(messages: list[dict]) -> str:
    return "\n".join(str(m.get("content") or "") for m in messages)


def _prompt(record: dict, key: str, source: str) -> list[dict]:
    value = _field(record, key, source)
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return _messages(record, key, source)


def _messages(record: dict, key: str, source: str) -> list[dict]:
    value = _field(record, key, source)
    ok = (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )
    if not ok:
        raise RecordError(
            source,
            "wrong_type",
            f"field {key!r} must be a non-empty list of {{role, content}} objects",
        )
    return value


def _tools(record: dict, key: str) -> Any:
    return record.get(key) or None


def _text(record: dict, key: str, source: str) -> str:
    value = _field(record, key, source)
    if not isinstance(value, str):
        raise RecordError(
            source, "wrong_type", f"field {key!r} must be a string, got {_kind(value)}"
        )
    return value


def _field(record: dict, key: str, source: str) -> Any:
    if key not in record:
        raise RecordError(source, "missing_field", f"no field {key!r}")
    return record[key]


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )
