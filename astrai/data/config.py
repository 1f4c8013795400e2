"""What `prepare` reads: a data TOML decoded into frozen Structs (docs/data.md lists every key)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from astrai.config import ConfigError, from_dict, read_toml

Kind = Literal["seq", "sft", "dpo", "grpo"]
Format = Literal["text", "chat", "prompt_response", "preference", "prompt"]

# The formats each kind can be built from; the first one is the kind's default.
KIND_FORMATS: dict[str, tuple[str, ...]] = {
    "seq": ("text", "chat", "prompt_response"),
    "sft": ("chat", "prompt_response", "text"),
    "dpo": ("preference",),
    "grpo": ("prompt",),
}

# Which sections carry loss when `train_on` is not given.
KIND_TRAIN_ON: dict[str, str] = {
    "seq": "all",
    "sft": "assistant",
    "dpo": "assistant",
    "grpo": "all",
}


class Fields(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The record keys each part of a training example is read from."""

    text: str = "text"
    """text format: the text."""
    messages: str = "messages"
    """chat format: the list of `{role, content}` messages."""
    prompt: str = "prompt"
    """prompt_response, preference and prompt formats: a string or a message list."""
    response: str = "response"
    """prompt_response format: the reply."""
    chosen: str = "chosen"
    """preference format: the preferred reply."""
    rejected: str = "rejected"
    """preference format: the other reply."""
    answer: str = "answer"
    """prompt format: the reference answer, kept for reward functions."""
    tools: str = "tools"
    """Tool signatures rendered by the chat template, when a record has them."""


class DataConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How JSONL records become token shards."""

    tokenizer: str
    """Folder holding the tokenizer (`tokenizer.json`)."""
    inputs: list[str]
    """JSONL files or globs (`**` allowed), read in the order given."""
    output: str = ""
    """Folder to write; required by `prepare`."""
    kind: Kind = "seq"
    """What the data feeds: pretraining sequences, supervised fine-tuning, preference pairs or RL
    prompts."""
    format: Format | None = None
    """How a record becomes text. Not set: seq and sft read `text` and `chat`, dpo `preference`,
    grpo `prompt`."""
    template: Literal["chat", "plain"] = "chat"
    """Render prompts and replies through the tokenizer's chat template, or as plain text."""
    fields: Fields = Fields()
    """The `[fields]` table."""
    train_on: str | list[str] | None = None
    """Sections trained on: `all`, `assistant`, `last_assistant` or a list of roles. Not set: `all`
    for seq, grpo and text; `assistant` for sft and dpo."""
    add_bos: bool = False
    """text and plain formats: start each record with bos."""
    add_eos: bool = True
    """text and plain formats: end each record with eos."""
    max_seq_len: int = 2048
    """Tokens per row: the `T` of every batch."""
    min_chars: int = 0
    """Drop records with fewer characters."""
    max_chars: int | None = None
    """Drop records with more characters. Not set: no limit."""
    max_items: int | None = None
    """Stop after keeping this many records. Not set: all."""
    too_long: Literal["truncate", "drop", "split"] = "truncate"
    """A record longer than `max_seq_len` is cut, dropped, or split into pieces (not for dpo and
    grpo)."""
    truncate_side: Literal["right", "left"] = "right"
    """`right` keeps the beginning, `left` the end."""
    packing: Literal["none", "greedy", "bfd"] = "none"
    """How documents become rows: one per row, next fit, or best fit decreasing (dpo and grpo need
    `none`)."""
    positions: Literal["none", "continuous", "document"] = "none"
    """Store position ids counting along each row, or restarting at each document (which also masks
    attention across documents)."""
    shard_tokens: int = 1 << 25
    """About how many tokens one shard holds (2^25)."""
    strict: bool = False
    """Stop at the first bad record instead of skipping and counting it."""
    workers: int = 1
    """Processes that parse and tokenise; the output is the same for any number."""
    batch_records: int = 1000
    """Records per tokeniser call (a worker's unit of work)."""
    progress: bool = True
    """Draw a progress line on stderr."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("inputs must name at least one JSONL file or glob")
        for name in ("max_seq_len", "shard_tokens", "workers", "batch_records"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.shard_tokens < self.max_seq_len:
            raise ValueError(
                f"shard_tokens ({self.shard_tokens}) must hold at least one row of "
                f"max_seq_len ({self.max_seq_len})"
            )
        if self.format is not None and self.format not in KIND_FORMATS[self.kind]:
            allowed = ", ".join(KIND_FORMATS[self.kind])
            raise ValueError(
                f"format {self.format!r} cannot make {self.kind!r} data; use {allowed}"
            )
        if self.kind in ("dpo", "grpo") and self.packing != "none":
            raise ValueError(f"{self.kind!r} data is one record per row: packing must be 'none'")
        if self.kind in ("dpo", "grpo") and self.too_long == "split":
            raise ValueError(f"{self.kind!r} records cannot be split; too_long must not be 'split'")
        train_on = self.train_on
        if isinstance(train_on, list) and not all(isinstance(r, str) for r in train_on):
            raise ValueError("train_on must be 'all', 'assistant', 'last_assistant' or role names")

    @property
    def record_format(self) -> str:
        return self.format or KIND_FORMATS[self.kind][0]

    @property
    def loss_sections(self) -> str | tuple[str, ...]:
        """'all', 'last_assistant', or the roles whose sections are trained on."""
        train_on = self.train_on
        if train_on is None:  # plain text has no assistant turns: all of it is trained
            train_on = "all" if self.record_format == "text" else KIND_TRAIN_ON[self.kind]
        if isinstance(train_on, list):
            return tuple(train_on)
        if train_on in ("all", "last_assistant"):
            return train_on
        return (train_on,)


def data_config(
    data: dict[str, Any], source: str = "<dict>", base: Path | None = None
) -> DataConfig:
    """Decode a data config; relative paths are taken from `base` (the TOML's folder)."""
    cfg = from_dict(DataConfig, data, source)
    if base is None:
        return cfg
    return msgspec.structs.replace(
        cfg,
        tokenizer=_under(base, cfg.tokenizer),
        inputs=[_under(base, p) for p in cfg.inputs],
        output=_under(base, cfg.output) if cfg.output else "",
    )


def load_data_config(path: str | Path) -> DataConfig:
    """Read a data TOML: the keys at the top level, or under a [prepare] table (so that one
    file can also hold other tables, e.g. a training config's)."""
    path = Path(path)
    data = read_toml(path)
    source = str(path)
    if isinstance(data.get("prepare"), dict):
        data, source = data["prepare"], f"{path} [prepare]"
    return data_config(data, source, base=path.parent)


def _under(base: Path, p: str) -> str:
    return p if Path(p).is_absolute() else str(base / p)


__all__ = ["ConfigError", "DataConfig", "Fields", "data_config", "load_data_config"]
