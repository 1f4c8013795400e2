"""A decode step reading the keys in their pages against one gathering them, in one process.

    python programs/benchmark/paged_attention.py [--size q05] [--quantize int8] [--dtype float32]
        [--batch 16] [--context 160] [--rounds 10]

The two ways differ only in the attention of each layer (astrai/kernels/attention.c against a
gather of the pages and torch's fused kernel), so they run in one process on the same weights
and pool, in alternating rounds of a few steps, and the median step of each is printed: a drift
of the machine falls on both. The model is the benchmark's cached one (runs/bench/models).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import astrai
import astrai.infer.paged as paged
from astrai.infer import alloc_pages, decode_step, init_pages, prefill, prepare_params

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # programs/, for the benchmark package
from benchmark.models import model_folder

PAGE_SIZE = 16


def step_times(params, cfg, batch: int, context: int, rounds: int, steps: int = 5):
    """{in place: [ms a step per round], gathered: [...]} for `batch` rows at `context`."""
    per_row = context // PAGE_SIZE + 2
    dtype = params["model.norm.weight"].dtype
    pool = init_pages(cfg, batch * per_row, PAGE_SIZE, dtype, "cpu")
    pool, pages = alloc_pages(pool, batch * per_row)
    table = torch.tensor(pages).view(batch, per_row)
    prompt = torch.randint(10, cfg.vocab_size, (batch, context))
    logits, pool = prefill(params, cfg, pool, prompt, table, 0)
    tokens, positions = logits.argmax(-1), torch.full((batch,), context)
    reads_in_place = paged._reads_pages_in_place
    times = {"in place": [], "gathered": []}
    try:
        for _ in range(rounds):
            for way in times:
                paged._reads_pages_in_place = (
                    reads_in_place if way == "in place" else lambda *args: False
                )
                start = time.perf_counter()
                for _ in range(steps):  # the same position again: every step alike
                    logits, pool = decode_step(params, cfg, pool, tokens, positions, table)
                    tokens = logits.argmax(-1)
                times[way].append((time.perf_counter() - start) / steps * 1e3)
    finally:
        paged._reads_pages_in_place = reads_in_place
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="q05")
    parser.add_argument("--quantize", default="int8", help="int8, int4 or none")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    folder = model_folder(Path("runs/bench"), args.size)
    params, cfg = astrai.load_pretrained(folder, dtype=getattr(torch, args.dtype))
    params = prepare_params(params, None if args.quantize == "none" else args.quantize)
    with torch.inference_mode():
        times = step_times(params, cfg, args.batch, args.context, args.rounds)
    medians = {way: statistics.median(t) for way, t in times.items()}
    print(
        f"{args.size} {args.quantize} {args.dtype}, batch {args.batch}, context {args.context}, "
        f"{torch.get_num_threads()} threads: in place {medians['in place']:.2f} ms a step, "
        f"gathered {medians['gathered']:.2f} ms ({medians['gathered'] / medians['in place']:.2f}x)"
    )


if __name__ == "__main__":
    main()
