"""Generate the demo's synthetic corpus: arithmetic dialogues and a little small talk.

Deterministic for a seed. Writes, into the output folder:
  pretrain.jsonl  {"text": ...}                  plain text for pretraining: dialogues, and drills
                                                 of bare questions and worked answers
  sft.jsonl       {"messages": [...]}            chat records for supervised fine-tuning
  grpo.jsonl      {"prompt": ..., "answer": ...} prompts with a reference answer for GRPO
  eval.jsonl      {"prompt": ..., "answer": ...} held-out problems that never appear above
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QUESTIONS = {
    "+": ["What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}.", "Add {a} and {b}.",
          "{a} + {b} = ?", "How much is {a} plus {b}?", "Please add {a} to {b}."],
    "-": ["What is {a} - {b}?", "What is {a} minus {b}?", "Compute {a} - {b}.",
          "Subtract {b} from {a}.", "{a} - {b} = ?", "How much is {a} minus {b}?"],
}  # fmt: skip

SMALL_TALK = [
    (["Hello!", "Hi!", "Hey there.", "Good morning!"], "Hello! Ask me to add or subtract numbers."),
    (["What can you do?", "What are you good at?", "Help"],
     "I can add and subtract whole numbers, for example: 12 + 30 = 42."),
    (["Who are you?", "What is your name?"], "I am a small AstrAI demo model that does arithmetic."),
    (["Thanks!", "Thank you.", "Great, thanks."], "You are welcome!"),
]  # fmt: skip

SYSTEM = "You are a helpful assistant."


def problem(rng: random.Random, max_value: int) -> tuple[int, str, int]:
    op = rng.choice("+-")
    a, b = rng.randint(0, max_value), rng.randint(0, max_value)
    if op == "-" and b > a:
        a, b = b, a  # keep answers non-negative
    return a, op, b


def equation(a: int, op: str, b: int) -> str:
    return f"{a} {op} {b} = {a + b if op == '+' else a - b}"


def digit_steps(a: int, op: str, b: int) -> list[str]:
    """Column arithmetic from the ones digit up: "7 + 8 = 15", then "3 + 4 + 1 = 8" with the
    carry; for subtraction a borrowed ten shows as "13 - 7 = 6" and the next column pays it."""
    steps, carry = [], 0
    while a or b or carry:
        x, y = a % 10, b % 10
        carried = f" {op} {carry}" if carry else ""
        if op == "+":
            total = x + y + carry
            steps.append(f"{x} + {y}{carried} = {total}")
            carry = total // 10
        else:
            borrow = int(x - y - carry < 0)
            steps.append(f"{x + 10 * borrow} - {y}{carried} = {x + 10 * borrow - y - carry}")
            carry = borrow
        a, b = a // 10, b // 10
    return steps


def answer(a: int, op: str, b: int) -> str:
    """Worked column by column, ending in the equation itself: small models learn the carries
    from a few thousand worked examples, where bare "37 + 48 = 85" takes far more."""
    return "; ".join([*digit_steps(a, op, b), f"so {equation(a, op, b)}"])


def question(rng: random.Random, a: int, op: str, b: int) -> str:
    return rng.choice(QUESTIONS[op]).format(a=a, b=b)


def held_out_problems(rng: random.Random, count: int) -> list[tuple[int, str, int]]:
    """Two-digit additions (the headline metric) and some subtractions, all distinct."""
    chosen: dict[tuple[int, str, int], None] = {}
    while len(chosen) < count:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = "+" if len(chosen) < count * 3 // 4 else "-"
        if op == "-" and b > a:
            a, b = b, a
        chosen[(a, op, b)] = None
    return list(chosen)


def generate(out: Path, seed: int = 0, records: int = 20000, eval_count: int = 200,
             max_value: int = 99) -> dict[str, int]:  # fmt: skip
    rng = random.Random(seed)
    held_out = held_out_problems(rng, eval_count)
    excluded = set(held_out)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        name: (out / f"{name}.jsonl").open("w") for name in ("pretrain", "sft", "grpo", "eval")
    }
    counts = dict.fromkeys(files, 0)

    def write(name: str, record: dict) -> None:
        files[name].write(json.dumps(record) + "\n")
        counts[name] += 1

    for i in range(records):
        if i % 10 == 9:
            prompts, reply = rng.choice(SMALL_TALK)
            user, text = rng.choice(prompts), reply
            record_answer = None
        else:
            p = problem(rng, max_value if rng.random() < 0.9 else 999)
            while p in excluded:
                p = problem(rng, max_value)
            user, text, record_answer = question(rng, *p), answer(*p), equation(*p).split(" = ")[1]
        write("pretrain", {"text": f"User: {user}\nAssistant: {text}"})
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        write("sft", {"messages": messages})
        if record_answer is not None and i % 4 == 0:
            write("grpo", {"prompt": user, "answer": record_answer})
    for _ in range(records):
        drill = []
        while len(drill) < 2:
            p = problem(rng, max_value)
            if p not in excluded:
                drill.append(f"{question(rng, *p)}\n{answer(*p)}")
        write("pretrain", {"text": "\n".join(drill)})
    for p in held_out:
        user = question(rng, *p)
        write("eval", {"prompt": user, "answer": equation(*p).split(" = ")[1],
                       "expected": equation(*p),
                       "text": f"User: {user}\nAssistant: {answer(*p)}"})  # fmt: skip
    for f in files.values():
        f.close()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/demo/data"), help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--records", type=int, default=20000, help="training records to generate")
    parser.add_argument("--eval", type=int, default=200, help="held-out problems")
    args = parser.parse_args()
    counts = generate(args.out, args.seed, args.records, args.eval)
    print(f"wrote {', '.join(f'{n} {k}' for k, n in counts.items())} records to {args.out}")


if __name__ == "__main__":
    main()
