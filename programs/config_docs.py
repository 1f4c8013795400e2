"""Write docs/configuration.md from the configuration Structs, so the reference cannot drift.

    python programs/config_docs.py           # rewrite docs/configuration.md
    python programs/config_docs.py --check   # exit 1 when docs/configuration.md is out of date

Keys, types, defaults, table intros (the Structs' docstrings) and what each key means (the
string under each field, read by `astrai.config.field_docs`) all come from the Structs
themselves. A field without its string is an error: a new field cannot go undocumented.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path

import msgspec

from astrai.config import (
    EngineConfig,
    EvalConfig,
    ServeConfig,
    TrainConfig,
    field_docs,
)
from astrai.data.config import DataConfig

OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

# (title, Struct, TOML table it is read from ("" = top level, None: none), what reads it)
SECTIONS = [
    (
        "Training: `just train run.toml`",
        TrainConfig,
        "",
        "`load_train_config` reads the keys at the top level of the TOML, with nested tables for "
        "the model, the optimizer and so on. Relative paths are taken from the TOML's folder. "
        "A `[prepare]` table (the data pipeline's, below) may sit in the same file and is "
        "ignored here. The `[model]` table holds the same keys as a model folder's config.json. "
        "docs/training.md describes the run itself.",
    ),
    (
        "Data: `just prepare data.toml`",
        DataConfig,
        "",
        "`load_data_config` reads the keys at the top level of the TOML, or under a `[prepare]` "
        "table (then `[fields]` is `[prepare.fields]`). Relative paths are taken from the TOML's "
        "folder. docs/data.md describes the pipeline.",
    ),
    (
        "Evaluation: `just eval eval.toml`",
        EvalConfig,
        "eval",
        "`load_eval_config` reads the `[eval]` table of a TOML (a training TOML's `[eval]` is "
        "the same table); each `[[eval.tasks]]` entry is one task. Relative paths are taken "
        "from the TOML's folder. docs/evaluation.md describes the tasks and their metrics.",
    ),
    (
        "Inference engine: `Engine(...)`, `init_engine(...)`, `[serve]`",
        EngineConfig,
        None,
        "`Engine(params, cfg, tokenizer, config, **settings)` and `init_engine` take an "
        "`EngineConfig` and/or its fields as keyword arguments; `just serve` reads the same keys "
        "from its `[serve]` table. docs/inference.md describes the engine.",
    ),
    (
        "Serving: `just serve --config serve.toml`",
        ServeConfig,
        "serve",
        "`just serve` takes the defaults, then the `[serve]` table of `--config`, then its flags "
        "(`--max-batch 8` sets `max_batch`; every key has its flag). docs/serving.md describes "
        "the server.",
    ),
]


def struct_of(tp) -> type | None:
    """The Struct class inside `tp` (a Struct or `Struct | None`), else None."""
    args = typing.get_args(tp) if is_union(tp) else (tp,)
    found = [a for a in args if isinstance(a, type) and issubclass(a, msgspec.Struct)]
    return found[0] if found else None


def item_struct(tp) -> type | None:
    """The Struct of a list of tables (`tuple[Struct, ...]`, TOML's `[[table]]`), else None."""
    if typing.get_origin(tp) not in (list, tuple):
        return None
    first = typing.get_args(tp)[0]
    return first if isinstance(first, type) and issubclass(first, msgspec.Struct) else None


def is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def type_text(tp) -> str:
    if is_union(tp):  # None is shown as "not set" in the default column instead
        return " or ".join(type_text(a) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in typing.get_args(tp))
    if item_struct(tp):
        return "list of tables"
    if typing.get_origin(tp) in (list, tuple):
        item = typing.get_args(tp)[0]
        if typing.get_origin(item) is typing.Literal:
            return "list of " + type_text(item)
        return "list of " + {str: "strings", int: "ints", float: "floats"}[item]
    if struct_of(tp):
        return "table"
    return {int: "int", float: "float", bool: "bool", str: "string"}[tp]


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def default_text(field) -> str:
    if field.required:
        return "(required)"
    value = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    if value is None:
        return "not set"
    if isinstance(value, msgspec.Struct):
        return "its defaults"
    return f"`{toml_value(value)}`"


def intro(struct: type) -> str:
    """The docstring's first paragraph, without the "[table]: " that the heading shows."""
    text = (struct.__doc__ or "").strip().split("\n\n")[0]
    text = " ".join(text.split())
    if text.startswith("[") and "]: " in text:
        text = text.split("]: ", 1)[1]
    return text[0].upper() + text[1:]


def meanings(struct: type) -> dict[str, str]:
    given = field_docs(struct)
    missing = [f.name for f in msgspec.structs.fields(struct) if f.name not in given]
    if missing:
        raise SystemExit(
            f"{struct.__module__}.{struct.__name__}: fields {missing} have no documentation; "
            'write what each means in a """string""" on the line after it'
        )
    return given


def own_fields(struct: type) -> list:
    """The fields a Struct adds to the Struct it extends (whose table is shown on its own),
    and those whose default it changes."""
    base = struct.__mro__[1]
    if base is msgspec.Struct:
        return list(msgspec.structs.fields(struct))
    inherited = {f.name: f.default for f in msgspec.structs.fields(base)}
    return [
        f
        for f in msgspec.structs.fields(struct)
        if f.name not in inherited or inherited[f.name] != f.default
    ]


def tables(struct: type, path: str | None, array: bool = False) -> list[str]:
    """A heading and a key table for `struct`, then the same for each table nested in it
    (`array`: one of a list of tables, `[[path]]`)."""
    heading = "Keyword arguments" if path is None else f"`[{path}]`" if path else "Top level"
    heading = f"`[[{path}]]`" if array else heading
    lines = [f"### {heading}", "", f"{intro(struct)} (`{struct.__name__}`)", ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    said = meanings(struct)
    nested = []
    for field in own_fields(struct):
        row = [f"`{field.name}`", type_text(field.type), default_text(field), said[field.name]]
        lines.append("| " + " | ".join(row) + " |")
        inner, array = struct_of(field.type), False
        if inner is None and (inner := item_struct(field.type)):
            array = True
        if inner:
            nested.append((inner, f"{path}.{field.name}" if path else field.name, array))
    for inner, inner_path, array in nested:
        lines += ["", *tables(inner, inner_path, array)]
    return lines


def render() -> str:
    lines = [
        "<!-- Generated from the config Structs by programs/config_docs.py; do not edit by "
        "hand. Refresh: python programs/config_docs.py -->",
        "",
        "# Configuration",
        "",
        "Every setting is a field of a frozen msgspec Struct (`astrai/config.py`, "
        "`astrai/data/config.py`), read from TOML. An unknown key, a wrong type or an "
        "inconsistent value is a `ConfigError` that names the key and the file. A key left out "
        'takes its default; "not set" means the key is simply absent (TOML has no null).',
    ]
    for title, struct, table, reader in SECTIONS:
        lines += ["", f"## {title}", "", reader, "", *tables(struct, table)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is out of date: run python programs/config_docs.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
