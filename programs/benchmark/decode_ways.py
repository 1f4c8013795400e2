"""Two ways of a decode step against each other, in one process.

    python programs/benchmark/decode_ways.py [--compare attention|layers] [--size q05]
        [--quantize int8] [--dtype float32] [--batch 16] [--context 160] [--rounds 10]

`attention`: each layer reading the keys in their pages (astrai/kernels/attention.c) against
gathering them for torch's fused kernel, the layers run from Python. `layers`: every layer in
one C call (astrai/infer/fused_layers.py) against the layers run from Python one kernel at a
time. The two
ways differ in that alone, so they run in one process on the same weights and pool, in
alternating rounds of a few steps, and the median step of each is printed: a drift of the
machine falls on both. The model is the benchmark's cached one (runs/bench/models).
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


def _never(*args) -> None:
    return None


# each comparison's two ways: the functions of astrai.infer.paged each replaces
WAYS = {
    "attention": {
        "in place": {"fused_layers": _never},
        "gathered": {"fused_layers": _never, "_reads_pages_in_place": lambda *args: False},
    },
    "layers": {"one call": {}, "from Python": {"fused_layers": _never}},
}


def step_times(params, cfg, compare: str, batch: int, context: int, rounds: int, steps: int = 5):
    """{way: [ms a step per round]} of `compare`'s two ways for `batch` rows at `context`."""
    per_row = context // PAGE_SIZE + 2
    dtype = params["model.norm.weight"].dtype
    pool = init_pages(cfg, batch * per_row, PAGE_SIZE, dtype, "cpu")
    pool, pages = alloc_pages(pool, batch * per_row)
    table = torch.tensor(pages).view(batch, per_row)
    prompt = torch.randint(10, cfg.vocab_size, (batch, context))
    logits, pool = prefill(params, cfg, pool, prompt, table, 0)
    tokens, positions = logits.argmax(-1), torch.full((batch,), context)
    ways = WAYS[compare]
    kept = {name: getattr(paged, name) for way in ways.values() for name in way}
    times = {way: [] for way in ways}
    try:
        for _ in range(rounds):
            for way, replaced in ways.items():
                for name, function in kept.items():
                    setattr(paged, name, replaced.get(name, function))
                start = time.perf_counter()
                for _ in range(steps):  # the same position again: every step alike
                    logits, pool = decode_step(params, cfg, pool, tokens, positions, table)
                    tokens = logits.argmax(-1)
                times[way].append((time.perf_counter() - start) / steps * 1e3)
    finally:
        for name, function in kept.items():
            setattr(paged, name, function)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=sorted(WAYS), default="attention")
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
        times = step_times(params, cfg, args.compare, args.batch, args.context, args.rounds)
    (new, new_ms), (old, old_ms) = ((way, statistics.median(t)) for way, t in times.items())
    print(
        f"{args.size} {args.quantize} {args.dtype}, batch {args.batch}, context {args.context}, "
        f"{torch.get_num_threads()} threads: {new} {new_ms:.2f} ms a step, "
        f"{old} {old_ms:.2f} ms ({old_ms / new_ms:.2f}x)"
    )


if __name__ == "__main__":
    main()
