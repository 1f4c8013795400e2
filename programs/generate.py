"""Complete a JSONL file of prompts with a model, batched through the Engine.

    python programs/generate.py --model DIR --input prompts.jsonl [--output out.jsonl]
        [--speculative lookup | --speculative draft --draft-model DIR] [--speculative-k N]

Each input line is {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}
(rendered with the model's chat template). A line may also carry sampling fields
("max_tokens", "temperature", "stop", ...) that override the command line for that prompt,
and an "id" that is copied to its output line. Output can be held to a form: "json_schema" (a
JSON schema), "regex" or "choice" (a list of strings) on a line, or --json-schema FILE for every
line that gives none of them. Output lines come in input order:
{"index", "id"?, "text", "finish_reason", "usage": {"prompt_tokens", "cached_tokens",
"completion_tokens"}}. A progress line goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from speculation_flags import add_speculation_flags, check_draft, speculation_settings

from astrai.infer import ConstraintError, Engine, SamplingParams
from astrai.infer.constraints import choice, json_schema, regex
from astrai.model import DTYPES
from astrai.tokenizer import Tokenizer

# the fields of a line that hold its output to a form, and how each becomes a grammar
FORMS = {"json_schema": json_schema, "regex": regex, "choice": choice}
SAMPLING_FIELDS = set(SamplingParams.__struct_fields__) - {"constraint"}


class InputError(ValueError):
    """A bad input line; the message names the file and the line."""


def read_requests(path: str) -> list[dict]:
    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    requests = []
    with stream:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: invalid JSON: {exc}") from None
            if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
                raise InputError(f'{where}: expected an object with "prompt" or "messages"')
            unknown = set(record) - {"prompt", "messages", "id", *FORMS} - SAMPLING_FIELDS
            if unknown:
                raise InputError(f"{where}: unknown fields {sorted(unknown)}")
            forms = [k for k in FORMS if k in record]
            if len(forms) > 1:
                raise InputError(f"{where}: give one of {forms}, not several")
            requests.append({**record, "where": where})
    return requests


def constraint_of(record: dict, default):
    """The line's own form, else the file's (--json-schema); ConstraintError names a bad one."""
    for field, make in FORMS.items():
        if field in record:
            try:
                return make(record[field])
            except ValueError as exc:
                raise ConstraintError(f"{field}: {exc}") from None
    return default


def read_schema(path: str | None):
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json_schema(json.load(f))
    except (OSError, ValueError) as exc:
        raise InputError(f"--json-schema {path}: {exc}") from None


def prompt_of(record: dict, tokenizer: Tokenizer) -> str:
    if "messages" in record:
        return tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True)
    return record["prompt"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="model folder (save_pretrained or HF)")
    parser.add_argument("--input", required=True, help="JSONL prompts ('-' = stdin)")
    parser.add_argument("--output", default="-", help="JSONL completions ('-' = stdout)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, help="seed of every request (reproducible runs)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--json-schema", help="a JSON schema file every output must follow")
    parser.add_argument("--max-batch", type=int, default=64, help="requests decoded together")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], help="default: the checkpoint's; auto: bfloat16 where the CPU/GPU multiplies it natively")  # fmt: skip
    parser.add_argument(
        "--quantize", choices=["int8", "int4"], help="8- or 4-bit weights (default: none)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    add_speculation_flags(parser)
    args = parser.parse_args()
    defaults = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
    }
    try:
        requests = read_requests(args.input)
        file_constraint = read_schema(args.json_schema)
        tokenizer = Tokenizer.from_pretrained(args.model)
        check_draft(args.draft_model, args.model)
        engine = Engine.from_pretrained(
            args.model,
            tokenizer=tokenizer,
            max_batch=args.max_batch,
            dtype=args.dtype,
            quantize=args.quantize,
            **speculation_settings(args),
        )
    except (InputError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    try:
        ids = []
        for record in requests:
            sampling = defaults | {k: v for k, v in record.items() if k in SAMPLING_FIELDS}
            try:
                sampling["constraint"] = constraint_of(record, file_constraint)
                ids.append(engine.submit(prompt_of(record, tokenizer), **sampling))
            except ValueError as exc:  # PromptTooLong, a bad sampling field, ...
                raise InputError(f"{record['where']}: {exc}") from None
        start, generated = time.monotonic(), 0
        for index, (record, request_id) in enumerate(zip(requests, ids)):
            completion = engine.result(request_id)
            generated += completion.usage.completion_tokens
            line = {"index": index} | ({"id": record["id"]} if "id" in record else {})
            line |= {
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "usage": {
                    "prompt_tokens": completion.usage.prompt_tokens,
                    "cached_tokens": completion.usage.cached_tokens,
                    "completion_tokens": completion.usage.completion_tokens,
                },
            }
            if completion.error:
                line["error"] = completion.error
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
            if not args.quiet:
                rate = generated / max(time.monotonic() - start, 1e-9)
                print(
                    f"\r{index + 1}/{len(requests)} prompts, {generated} tokens, {rate:.1f} tok/s",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
        if not args.quiet:
            print(file=sys.stderr)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.close()
        if out is not sys.stdout:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
