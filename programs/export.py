"""Export a model folder to another runtime's file format.

    python programs/export.py --model DIR --format gguf --out FILE.gguf [--type f32|f16|bf16|q8_0|q4_0]

GGUF is the file llama.cpp and Ollama load: weights in the chosen type, the hyperparameters
and the tokenizer with its chat template, in one file (docs/export.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import astrai as ai
from astrai.config import ConfigError
from astrai.export import GGUF_TYPES, GGUFExportError, save_gguf
from astrai.model import CheckpointError


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a folder written by save_pretrained or a Hugging Face Llama/Qwen2/Qwen3/Mistral folder")  # fmt: skip
    parser.add_argument("--format", required=True, choices=["gguf"], help="the file format")
    parser.add_argument("--out", required=True, help="the file to write")
    parser.add_argument("--type", default="f32", choices=GGUF_TYPES, help="how weights are stored (vectors stay float32)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    model = Path(args.model)
    try:
        if not (model / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{model}: no tokenizer.json; a GGUF file carries the tokenizer")  # fmt: skip
        params, cfg = ai.load_pretrained(model)
        tokenizer = ai.Tokenizer.from_pretrained(model)
        save_gguf(args.out, params, cfg, tokenizer, type=args.type, name=model.resolve().name)
    except (GGUFExportError, CheckpointError, ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = Path(args.out).stat().st_size / 2**20
    print(f"wrote {args.out} ({size:.1f} MiB, {args.type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
