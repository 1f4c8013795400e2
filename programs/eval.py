"""Evaluate a model on the tasks of an [eval] table, or on one JSONL file.

    python programs/eval.py eval.toml [--model DIR] [--out results.json]
    python programs/eval.py --model DIR --data FILE.jsonl [--kind KIND] [--score numeric]
    python programs/eval.py ... --model BASE --lora ADAPTER   (one LoRA adapter over BASE)

With --data, the task's kind comes from the first record unless --kind says it: "text" is
perplexity, "choices" is multiple choice, "prompt" or "messages" with an "answer" is
generation. Results are printed as a table and written as JSON (default: eval.json in the model
folder, or the adapter's), with the model, each data file's checksum, the settings and the time
taken. --lora reads a PEFT adapter folder or a `just train` run's (its adapter/).
docs/evaluation.md describes the tasks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import msgspec

from astrai.config import ConfigError, EvalConfig, eval_config, load_eval_config
from astrai.eval import evaluate_tasks, format_table, model_of, read_records, write_results
from astrai.model import load_lora, load_pretrained, merge_lora
from astrai.model.lora_folder import adapter_folder
from astrai.tokenizer import Tokenizer


def guess_kind(path: str) -> str:
    """The kind of task a JSONL file's first record is made for."""
    first = read_records(path, limit=1)
    record = first[0] if first else {}
    if "choices" in record:
        return "choice"
    if "text" in record:
        return "perplexity"
    if ("prompt" in record or "messages" in record) and "answer" in record:
        return "generation"
    raise ConfigError(
        f"{path}: cannot tell the task from the first record's keys {sorted(record)}; "
        "give --kind (perplexity needs 'text', choice 'choices', generation 'prompt' and 'answer')"
    )


def task_from_flags(args) -> EvalConfig:
    task = {"name": Path(args.data).stem, "kind": args.kind or guess_kind(args.data)}
    task |= {"data": args.data, "score": args.score, "limit": args.limit}
    return eval_config({"tasks": [task], "batch_size": args.batch_size}, "command line")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", help="a TOML file with an [eval] table")
    parser.add_argument("--model", help="model folder (overrides [eval] model)")
    parser.add_argument("--lora", help="a LoRA adapter folder (PEFT's, or a run's) over --model")
    parser.add_argument("--data", help="one JSONL file to evaluate, instead of a config")
    parser.add_argument("--kind", choices=("perplexity", "generation", "choice"))
    parser.add_argument("--score", default="exact", help="generation: exact, regex, numeric...")
    parser.add_argument("--limit", type=int, default=0, help="only the first N records")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", help="cpu, cuda, ... (overrides [eval] device)")
    parser.add_argument(
        "--out", type=Path, help="results JSON (default MODEL/eval.json, or ADAPTER/eval.json)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if (args.config is None) == (args.data is None):
        parser.error("give a config TOML or --data FILE.jsonl (one of them)")
    return args


def with_adapter(params: dict, model_cfg, path: str) -> dict:
    """The base params with the adapter at `path` merged in: one adapter for every request,
    so merging once costs less than adding its update at each product."""
    weight = next(iter(params.values()))
    lora, _ = load_lora(path, model_cfg, dtype=weight.dtype, device=weight.device)
    return merge_lora(params, lora)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_eval_config(args.config) if args.config else task_from_flags(args)
        model_dir = args.model or cfg.model
        if not model_dir:
            raise ConfigError("no model: give --model DIR or [eval] model")
        device = args.device or cfg.device
        cfg = msgspec.structs.replace(cfg, device=device)
        started = time.monotonic()
        params, model_cfg = load_pretrained(model_dir, device=device)
        label, results_dir = str(model_dir), Path(model_dir)
        if args.lora:
            params, results_dir = (
                with_adapter(params, model_cfg, args.lora),
                adapter_folder(args.lora),
            )
            label = f"{model_dir} + {results_dir}"
        model = model_of(params, model_cfg, Tokenizer.from_pretrained(model_dir))
        results = evaluate_tasks(model, cfg, None if args.quiet else sys.stderr)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = args.out or Path(cfg.out or results_dir / "eval.json")
    write_results(out, label, results, time.monotonic() - started)
    print(format_table(label, results))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
