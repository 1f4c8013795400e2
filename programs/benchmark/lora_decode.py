"""Decode steps of a batch mixing LoRA adapters against the same batch on the base model alone.

    python programs/benchmark/lora_decode.py [--rows 16] [--dtype bfloat16] [--rounds 4] [--parts]
        [--targets q_proj,v_proj]

The small benchmark model (random weights, q/k/v and gate/up fused as the Engine has them, in
the plain layout so that both sides multiply alike), `rows`
sequences 64 tokens in, one token each per decode_step. The `mixed` side binds an adapter stack
(laid out fused as the weights, or with --parts one update per part) of 8 adapters of rank 16 on every projection
(or on --targets), the rows spread over the 8 adapters and
the base model alone (astrai.model.lora_product); the `base` side passes no adapters. Each
side runs in a process of its own with one thread; the rounds alternate the order, and each
side's best pass of 16 steps counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import astrai as ai
from astrai.config import LORA_TARGETS
from astrai.infer import alloc_pages, decode_step, init_pages
from astrai.infer.prepare import fuse_projections
from astrai.model.adapter_stack import adapter_slots, init_adapter_stack, stack_adapter
from astrai.model.lora_product import mixed_lora

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, intermediate_size=1408, vocab_size=32000)  # fmt: skip
ADAPTERS, RANK, START, STEPS, PAGE = 8, 16, 64, 16, 16


def _mixed(params, cfg, rows: int, dtype: torch.dtype, fused: bool, targets) -> dict:
    stack = init_adapter_stack(cfg, ADAPTERS, RANK, targets, dtype=dtype, fused=fused)
    for i in range(ADAPTERS):
        lora = ai.init_lora(params, cfg, RANK, 32.0, targets, seed=i)
        for pair in lora["weights"].values():
            pair["B"].normal_(0.0, 0.01)
        stack = stack_adapter(stack, f"adapter{i}", lora)
    names = [None if i % (ADAPTERS + 1) == ADAPTERS else f"adapter{i % 9}" for i in range(rows)]
    return mixed_lora(stack, adapter_slots(stack, names))


def side(name: str, rows: int, dtype: torch.dtype, fused: bool, targets=LORA_TARGETS) -> float:
    """Milliseconds per decode step, best pass of STEPS steps (after a warm-up pass)."""
    torch.set_num_threads(1)
    cfg = ai.ModelConfig(**SHAPE, tie_word_embeddings=True, max_position_embeddings=256)
    params = {k: v.to(dtype) for k, v in ai.init_params(cfg, seed=0).items()}
    lora = _mixed(params, cfg, rows, dtype, fused, targets) if name == "mixed" else None
    prepared = fuse_projections(params)  # fused as the Engine's; one layout on both sides
    width = (START + 3 * STEPS) // PAGE + 1
    pool, pages = alloc_pages(init_pages(cfg, rows * width, PAGE, dtype), rows * width)
    table = torch.tensor(pages).view(rows, width)
    tokens = torch.randint(0, cfg.vocab_size, (rows,), generator=torch.Generator().manual_seed(0))
    best, position = float("inf"), START
    with torch.no_grad():
        for rep in range(3):
            start = time.perf_counter()
            for _ in range(STEPS):
                positions = torch.full((rows,), position)
                _, pool = decode_step(prepared, cfg, pool, tokens, positions, table, lora)
                position += 1
            if rep:  # the first pass warms up
                best = min(best, (time.perf_counter() - start) / STEPS)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--parts", action="store_true", help="a stack of one update per part")
    parser.add_argument("--targets", default=",".join(LORA_TARGETS), help="adapted modules")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.side:
        targets = tuple(args.targets.split(","))
        print(json.dumps(side(args.side, args.rows, dtype, not args.parts, targets)))
        return 0
    best = {"base": float("inf"), "mixed": float("inf")}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for r in range(args.rounds):
        for name in list(best) if r % 2 == 0 else list(best)[::-1]:
            command = [sys.executable, __file__, "--side", name, "--rows", str(args.rows)]
            command += (["--parts"] if args.parts else []) + ["--targets", args.targets]
            out = subprocess.run(
                [*command, "--dtype", args.dtype], capture_output=True, text=True, env=env
            )
            if out.returncode:
                raise RuntimeError(f"{name}: {out.stderr}")
            best[name] = min(best[name], float(out.stdout))
    layout = "one update per part" if args.parts else "fused"
    print(
        f"{args.dtype}, {args.rows} rows, {ADAPTERS} adapters of rank {RANK} on {args.targets}, "
        f"{layout}"
    )
    for name, ms in best.items():
        print(f"{name:<6} {ms:8.3f} ms a step  {best['base'] / ms:5.2f}x the base's tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
