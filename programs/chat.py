"""Chat with a model in the terminal; replies stream token by token.

    just chat [--model DIR] [--system TEXT] [--temperature T] [--max-tokens N] [--seed S]
        [--speculative lookup | --speculative draft --draft-model DIR] [--speculative-k N]

Each line you type is one user message. The whole conversation is rendered with the model's
chat template, so the model sees every earlier turn (and the engine's prefix cache reuses
their K/V instead of recomputing them).

    /reset    forget the conversation (the --system message stays)
    /exit     leave (so does Ctrl-D)

Ctrl-C during a reply stops it: what was already shown stays in the conversation (a reply
stopped before its first word is forgotten along with its message). Lines may be piped in
(`echo hi | just chat`): replies go to stdout, one after another, until the input ends.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from speculation_flags import add_speculation_flags, check_draft, speculation_settings

DEMO_MODEL = Path("runs/demo/model")
COMMANDS = "/reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops a reply"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help=f"model folder (default: {DEMO_MODEL}, made by `just demo`)"
    )
    parser.add_argument("--system", help="a system message that starts the conversation")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="longest reply (default 512; always cut to what is left of the context)",
    )
    parser.add_argument("--seed", type=int, help="reply i uses seed + i: a session replays exactly")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), help="weights and K/V (default: float32; auto: bfloat16 where it is native)")  # fmt: skip
    parser.add_argument(
        "--quantize", choices=["int8", "int4"], help="8- or 4-bit weights (default: none)"
    )
    add_speculation_flags(parser)
    return parser.parse_args(argv)


def load_engine(
    folder: Path,
    dtype: str | None = None,
    quantize: str | None = None,
    speculation: dict | None = None,
):
    from astrai.infer import Engine
    from astrai.model import model_config_from_json
    from astrai.tokenizer import Tokenizer

    if model_config_from_json(folder / "config.json").model_type != "decoder":
        raise ValueError("this is an encoder model; it makes embeddings, not replies")
    tokenizer = Tokenizer.from_pretrained(folder)
    # One conversation at a time: a pool for one full-length sequence is all it needs.
    engine = Engine.from_pretrained(
        folder,
        tokenizer=tokenizer,
        max_batch=1,
        dtype=dtype,
        quantize=quantize,
        **(speculation or {}),
    )
    return engine, tokenizer


def reply(engine, tokenizer, messages: list[dict], args, turn: int) -> str | None:
    """Stream the assistant's answer to `messages` to stdout; None when it is stopped before
    saying anything or cannot be made."""
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    room = engine.max_seq_len - len(prompt)
    if room <= 0:
        print(
            f"(the conversation fills the model's context of {engine.max_seq_len} tokens; "
            "/reset starts over)",
            file=sys.stderr,
        )
        return None
    seed = None if args.seed is None else args.seed + turn
    sampling = dict(max_tokens=min(args.max_tokens, room), temperature=args.temperature, seed=seed)
    text, finish, error = "", None, None
    # closing the stream (also on Ctrl-C) cancels the request and frees its pages
    with contextlib.closing(engine.stream(prompt, **sampling)) as events:
        try:
            for event in events:
                print(event.text, end="", flush=True)
                text += event.text
                finish, error = event.finish_reason, event.error
        except KeyboardInterrupt:
            finish = "stopped"
    print(flush=True)
    if finish == "error":
        print(f"(error: {error})", file=sys.stderr)
        return None
    if finish in ("stopped", "length"):
        why = "stopped" if finish == "stopped" else "cut at --max-tokens or the context"
        print(f"({why})", file=sys.stderr)
    return text or None


def chat(engine, tokenizer, args, interactive: bool) -> None:
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages, turn = list(start), 0
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:  # Ctrl-D, or the end of piped input
            if interactive:
                print()
            return
        except KeyboardInterrupt:  # at the prompt Ctrl-C only clears the line
            print(f"\n({COMMANDS})", file=sys.stderr)
            continue
        line = line.strip()
        if line == "/exit":
            return
        if line == "/reset":
            messages = list(start)
            print("(conversation forgotten)", file=sys.stderr)
            continue
        if line.startswith("/"):
            print(f"(unknown command {line.split()[0]}; {COMMANDS})", file=sys.stderr)
            continue
        if not line:
            continue
        answer = reply(
            engine, tokenizer, [*messages, {"role": "user", "content": line}], args, turn
        )
        turn += 1
        if answer is not None:
            messages += [
                {"role": "user", "content": line},
                {"role": "assistant", "content": answer},
            ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = Path(args.model) if args.model else DEMO_MODEL
    if args.model is None and not folder.is_dir():
        print(
            f"No --model given, and there is no demo model at {DEMO_MODEL}.\n"
            "Make it (a few minutes on a laptop) with:\n\n    just demo\n",
            file=sys.stderr,
        )
        return 2
    try:
        speculation = speculation_settings(args)
        check_draft(args.draft_model, folder)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        engine, tokenizer = load_engine(folder, args.dtype, args.quantize, speculation)
    except (OSError, ValueError) as exc:  # a missing folder, a bad config.json or checkpoint
        print(f"error: cannot load {folder}: {exc}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        print(f"Chatting with {folder} ({COMMANDS})", file=sys.stderr)
    try:
        chat(engine, tokenizer, args, interactive)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # outside a reply, e.g. while the model loads: just leave
        sys.exit(130)
