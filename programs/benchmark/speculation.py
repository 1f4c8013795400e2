"""Speculative decoding by prompt lookup at batch 1, against plain decoding, on a grounded
workload: the model quotes a document given in its prompt, so the tokens it writes are in the
prompt already. Each side runs in a process of its own, rounds alternating; both sides run
the same loop (astrai/infer/speculative_loop.py), plain decoding with no proposer, and must
give the same greedy tokens.

    python programs/benchmark/speculation.py [--shape tiny] [--k 4] [--rounds 3]

A model that copies is trained first (once; kept in --folder): random documents, a separator,
then the document again, the loss on the copy only. It learns to copy in a few hundred steps at
the tiny shape. Speed is reported as generated tokens per second of the whole request (its
prompt's prefill included, the same on both sides), with tokens per verification step and the
acceptance rate, the lookup's own cost per proposal at a long context, and what a verification
forward of k + 1 tokens costs against a decode step at a larger shape (--cost-shape, random
weights).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmark package

import torch

import astrai as ai
from astrai.infer import alloc_pages, decode_step, init_pages, pages_for, prefill, verify_forward
from astrai.infer.lookup import extend_lookup, init_lookup, propose_lookup
from astrai.infer.speculative_loop import speculative_generate
from benchmark.models import COMMON, SIZES
from benchmark.timing import interleave, median

SEP, DOC, QUOTE = 1, 48, 40  # separator id; document and quote lengths in training
# copying needs no large vocabulary, and a small one keeps training to minutes on 2 cores
VOCAB = 1024
IGNORE = -100


def copy_batch(vocab: int, batch: int, generator: torch.Generator) -> dict:
    """Documents of random tokens, SEP, then the document again from its start; the loss on
    the copy only (the documents themselves cannot be predicted). Copying at a fixed distance
    is learned in a few hundred steps; quoting from an arbitrary place (induction) takes far
    longer to appear."""
    docs = torch.randint(2, vocab, (batch, DOC), generator=generator)
    ids = torch.cat([docs, torch.full((batch, 1), SEP), docs[:, :QUOTE]], dim=1)
    labels = torch.full_like(ids, IGNORE)
    labels[:, DOC:-1] = ids[:, DOC + 1 :]  # label t = token t + 1, from SEP on
    return {"input_ids": ids, "labels": labels}


def train_copier(folder: Path, shape: str, steps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    cfg = ai.ModelConfig(**{**COMMON, **SIZES[shape], "vocab_size": VOCAB})
    train_cfg = ai.TrainConfig(
        model=cfg,
        max_steps=steps,
        batch_size=16,
        optimizer=ai.config.OptimizerConfig(lr=2e-3, weight_decay=0.0),
        schedule=ai.config.ScheduleConfig(warmup_steps=steps // 10),
        progress=False,
    )
    state = ai.init_train_state(ai.init_params(cfg, seed=0), train_cfg)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        state, metrics = ai.train_step(state, copy_batch(cfg.vocab_size, 16, generator))
        if step % 25 == 0 or step == steps - 1:
            print(f"train step {step}: loss {metrics['loss']:.3f}", file=sys.stderr)
    ai.save_pretrained(folder, state.params, cfg)


def prompts(vocab: int, count: int, new_tokens: int) -> list[list[int]]:
    """A document, SEP and the first part of the copy: the model goes on copying."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        doc = torch.randint(2, vocab, (DOC,), generator=generator).tolist()
        copied = int(torch.randint(1, QUOTE - new_tokens, (), generator=generator))
        out.append([*doc, SEP, *doc[:copied]])
    return out


def side(args) -> dict:
    """One side's measurement, in this process."""
    torch.set_num_threads(args.threads)
    params, cfg = ai.load_pretrained(args.folder)
    params = ai.prepare_params(params)
    work = prompts(cfg.vocab_size, args.prompts, args.new_tokens)
    ps = 16
    pool = init_pages(cfg, pages_for(DOC + 2 + args.new_tokens + args.k + 1, ps) + 1, ps)
    seconds, outputs, steps, proposed, accepted = 0.0, [], 0, 0, 0
    with torch.no_grad():
        for i, prompt in enumerate([work[0], *work]):  # the first run warms up
            proposer = init_lookup(prompt, 1, args.max_n) if args.side == "lookup" else None
            start = time.perf_counter()
            tokens, stats, pool, _ = speculative_generate(
                params, cfg, pool, prompt, args.new_tokens, proposer, args.k
            )
            if i:
                seconds += time.perf_counter() - start
                outputs.append(tokens)
                steps, proposed, accepted = (
                    steps + stats.steps,
                    proposed + stats.proposed,
                    accepted + stats.accepted,
                )
    return {
        "tokens_per_s": args.prompts * args.new_tokens / seconds,
        "steps": steps,
        "proposed": proposed,
        "accepted": accepted,
        "outputs": outputs,
    }


def verify_cost(shape: str, k: int, context: int = 256, repeats: int = 10) -> dict:
    """Milliseconds of a decode step and of a verification forward of k + 1 tokens at batch 1,
    random weights of `shape`, alternating calls: what a step that keeps a tokens costs
    against the a + 1 decode steps it replaces."""
    cfg = ai.ModelConfig(**{**COMMON, **SIZES[shape]})
    params = ai.prepare_params(ai.init_params(cfg, seed=0))
    ps = 16
    pool = init_pages(cfg, pages_for(context + k + 1, ps), ps)
    pool, pages = alloc_pages(pool, pages_for(context + k + 1, ps))
    table = torch.tensor([pages])
    prompt = torch.randint(0, cfg.vocab_size, (1, context), generator=torch.Generator())
    times = {"decode": [], "verify": []}
    with torch.no_grad():
        _, pool = prefill(params, cfg, pool, prompt, table, 0)
        for r in range(repeats + 1):
            start = time.perf_counter()
            _, pool = decode_step(params, cfg, pool, prompt[0, :1], torch.tensor([context]), table)
            middle = time.perf_counter()
            proposal = prompt[0, 1 : k + 1].tolist()
            _, pool = verify_forward(params, cfg, pool, [1], [proposal], [context], table)
            if r:  # the first of each warms up
                times["decode"].append((middle - start) * 1e3)
                times["verify"].append((time.perf_counter() - middle) * 1e3)
    return {name: median(values) for name, values in times.items()}


def lookup_cost(context: int, max_n: int, k: int, repeats: int = 2000) -> float:
    """Microseconds per propose + extend-by-one at a context of `context` tokens."""
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 32000, (context,), generator=generator).tolist()
    index = init_lookup(tokens, 1, max_n)
    start = time.perf_counter()
    for i in range(repeats):
        propose_lookup(index, k)
        index = extend_lookup(index, [tokens[i]])
    return (time.perf_counter() - start) / repeats * 1e6


def run_side(args, name: str) -> dict:
    command = [sys.executable, __file__, "--side", name, "--folder", str(args.folder)]
    for key in ("k", "max_n", "prompts", "new_tokens", "threads", "cost_shape"):
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=list(SIZES))
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-n", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cost-shape", default="small", choices=list(SIZES))
    parser.add_argument("--side", choices=["plain", "lookup", "cost"], default=None)
    args = parser.parse_args()
    if not 0 < args.new_tokens < QUOTE - 1:
        parser.error(f"--new-tokens: 1 to {QUOTE - 2}, within the copies the model learned")
    args.folder = args.folder or Path("runs") / f"bench-speculation-{args.shape}"
    if args.side == "cost":
        torch.set_num_threads(args.threads)
        print(json.dumps(verify_cost(args.cost_shape, args.k)))
        return
    if args.side:
        print(json.dumps(side(args)))
        return
    if not (args.folder / "config.json").exists():
        train_copier(args.folder, args.shape, args.train_steps, args.threads)
    results: dict[str, list[dict]] = {"plain": [], "lookup": []}

    def measure(name):
        def once(_round: int) -> float:
            results[name].append(run_side(args, name))
            return results[name][-1]["tokens_per_s"]

        return once

    rates = interleave({name: measure(name) for name in results}, args.rounds)
    if results["plain"][0]["outputs"] != results["lookup"][0]["outputs"]:
        raise SystemExit("lookup's greedy tokens differ from plain decoding's")
    lookup = results["lookup"][0]
    report = {
        "shape": args.shape,
        "k": args.k,
        "plain_tokens_per_s": median(rates["plain"]),
        "lookup_tokens_per_s": median(rates["lookup"]),
        "speedup": median(rates["lookup"]) / median(rates["plain"]),
        "tokens_per_step": (lookup["accepted"] + lookup["steps"]) / lookup["steps"],
        "acceptance": lookup["accepted"] / max(1, lookup["proposed"]),
        "lookup_us_at_8k_context": lookup_cost(8192, args.max_n, args.k),
        f"{args.cost_shape}_ms_decode_and_verify_k{args.k}": run_side(args, "cost"),
        "rounds": {name: [round(r, 1) for r in values] for name, values in rates.items()},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
