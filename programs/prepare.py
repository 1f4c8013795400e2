"""Prepare training data: JSONL records -> token shards, as a data TOML says.

    python programs/prepare.py data.toml [--output DIR] [--workers N] [--strict]

Every key of the TOML is described in docs/data.md. Paths in it are relative to the TOML's
folder. The output folder is replaced only once the new shards and index are complete.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from astrai.config import ConfigError
from astrai.data import RecordError, ShardError, data_config, load_data_config, prepare


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", help="data TOML (keys at the top level or under [prepare])")
    parser.add_argument("--output", help="folder to write (overrides `output`)")
    parser.add_argument("--workers", type=int, help="tokenising processes (overrides `workers`)")
    parser.add_argument("--max-items", type=int, help="keep at most this many records")
    parser.add_argument("--strict", action="store_true", help="stop at the first bad record")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args()
    try:
        cfg = load_data_config(args.config)
        changes = {
            "output": args.output,
            "workers": args.workers,
            "max_items": args.max_items,
            "strict": True if args.strict else None,
            "progress": False if args.quiet else None,
        }
        changes = {k: v for k, v in changes.items() if v is not None}
        if changes:
            cfg = data_config(
                {**msgspec.to_builtins(cfg), **changes}, f"{args.config} (command line)"
            )
        prepare(cfg, log=sys.stderr)
    except (ConfigError, RecordError, ShardError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
