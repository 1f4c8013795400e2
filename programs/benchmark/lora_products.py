"""How to add the LoRA updates of a batch whose rows use different adapters, measured here.

    python programs/benchmark/lora_products.py [--rows 16] [--dtype bfloat16] [--rounds 4]
        [--shape small|smol]

Each way runs in a process of its own (one torch thread), over the same stack of 8 adapters of
rank 16 on matrices of a benchmark model's MLP shape (small: 512 -> 1408, smol: 576 -> 1536), with the batch's
rows spread over the 8 adapters and the base model alone. The ways, each on top of the one base
product every row shares:

- stacked: all adapters multiply every row, a mask keeps each row's own (ours:
  astrai.model.lora_product);
- gathered: each row's A and B gathered, then batched products (Punica's BGMV);
- segmented: rows grouped by adapter, two products per group (S-LoRA's segmented GEMM).

And for q/k/v held as one matrix (astrai.infer.prepare): `parts` adds each part's update to its
slice (ours), `shared_a` multiplies by the parts' A stacked as one matrix and then by each
part's B, `blockdiag` one update with the parts' A stacked and their B block-diagonal.
The rounds alternate the order of the ways; the table gives each one's best pass, as a ratio
to the base product alone measured in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SLOTS, RANK, MATRICES = 8, 16, 16
# hidden size, MLP width, K/V width of the benchmark models (programs/benchmark/models.py)
SHAPES = {"small": (512, 1408, 128), "smol": (576, 1536, 192)}
IN, OUT, KV = SHAPES["small"]
WAYS = ("base", "stacked", "gathered", "segmented")
FUSED_WAYS = ("fused_base", "parts", "shared_a", "blockdiag")


def _stack(dtype: torch.dtype, out: int, g: torch.Generator) -> dict:
    return {
        "A": torch.randn(SLOTS * RANK, IN, generator=g).to(dtype) * 0.02,
        "B": torch.randn(out, SLOTS * RANK, generator=g).to(dtype) * 0.02,
        "W": torch.randn(out, IN, generator=g).to(dtype) * 0.02,
    }


def _stacked(x, m, mask):
    h = F.linear(x, m["A"]) * mask
    return F.linear(h, m["B"])


def _gathered(x, m, slots, scale):
    a = m["A"].view(SLOTS, RANK, IN).index_select(0, slots)  # [N, r, in]
    b = m["B"].view(-1, SLOTS, RANK).permute(1, 2, 0).index_select(0, slots)  # [N, r, out]
    h = torch.bmm(x[:, None], a.transpose(1, 2)) * scale[:, None, None]
    return torch.bmm(h, b)[:, 0]


def _segmented(x, m, groups, y):
    for slot, rows in groups:
        a = m["A"][slot * RANK : (slot + 1) * RANK]
        b = m["B"][:, slot * RANK : (slot + 1) * RANK]
        y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b), alpha=2.0)
    return y


def _pass(way: str, x: torch.Tensor, mats: list, binding: dict) -> None:
    for m in mats:
        y = F.linear(x, m["W"])
        if way == "stacked":
            y = y + _stacked(x, m, binding["mask"])
        elif way == "gathered":
            y = y + _gathered(x, m, binding["slots"], binding["scale"])
        elif way == "segmented":
            _segmented(x, m, binding["groups"], y)


def _fused_pass(way: str, x, mats, binding) -> None:
    for m in mats:
        y = F.linear(x, m["W"])
        if way == "parts":
            q, k, v = y.split_with_sizes([IN, KV, KV], dim=-1)
            _ = [p + _stacked(x, part, binding["mask"]) for p, part in zip((q, k, v), m["parts"])]
        elif way == "shared_a":  # the parts' A as one matrix: one product, then each B
            q, k, v = y.split_with_sizes([IN, KV, KV], dim=-1)
            h = F.linear(x, m["parts_a"]) * binding["mask_parts"]
            hs = h.split(SLOTS * RANK, dim=-1)
            _ = [p + F.linear(hp, part["B"]) for p, hp, part in zip((q, k, v), hs, m["parts"])]
        elif way == "blockdiag":
            y = y + _stacked(x, m["block"], binding["mask3"])


def _binding(rows: int, dtype: torch.dtype) -> dict:
    slots = torch.arange(rows) % (SLOTS + 1) - 1  # -1: the base model alone
    used = slots >= 0
    scale = (used * 2.0).to(dtype)
    own = F.one_hot(slots.clamp(min=0), SLOTS).to(dtype) * scale[:, None]
    groups = [(s, (slots == s).nonzero()[:, 0]) for s in range(SLOTS) if bool((slots == s).any())]
    return {
        "slots": slots.clamp(min=0),
        "scale": scale,
        "mask": own.repeat_interleave(RANK, dim=1),
        "mask3": own.repeat_interleave(3 * RANK, dim=1),
        "mask_parts": own.repeat_interleave(RANK, dim=1).repeat(1, 3),
        "groups": groups,
    }


def _fused_matrices(dtype, g) -> list:
    widths = (IN, KV, KV)  # q, k, v
    mats = []
    for _ in range(MATRICES):
        parts = [_stack(dtype, w, g) for w in widths]
        block_b = torch.zeros(sum(widths), SLOTS * 3 * RANK, dtype=dtype)
        row = 0
        for i, (w, part) in enumerate(zip(widths, parts)):
            for s in range(SLOTS):
                cols = slice(s * 3 * RANK + i * RANK, s * 3 * RANK + (i + 1) * RANK)
                block_b[row : row + w, cols] = part["B"][:, s * RANK : (s + 1) * RANK]
            row += w
        a = torch.stack([p["A"].view(SLOTS, RANK, IN) for p in parts], 1).view(-1, IN)
        w = torch.cat([p["W"] for p in parts])
        parts_a = torch.cat([p["A"] for p in parts])  # part-major: each part's slots together
        mats.append({"W": w, "parts": parts, "parts_a": parts_a, "block": {"A": a, "B": block_b}})
    return mats


def side(way: str, rows: int, dtype: torch.dtype, passes: int = 5) -> float:
    """Milliseconds of the best of `passes` passes of one way over the matrices."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    binding = _binding(rows, dtype)
    x = torch.randn(rows, IN, generator=g).to(dtype)
    if way in FUSED_WAYS:
        mats, run = _fused_matrices(dtype, g), _fused_pass
    else:
        mats, run = [_stack(dtype, OUT, g) for _ in range(MATRICES)], _pass
    with torch.no_grad():
        run(way, x, mats, binding)  # warm-up
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            run(way, x, mats, binding)
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16, help="rows of the batch (tokens)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--shape", default="small", choices=tuple(SHAPES))
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    global IN, OUT, KV
    IN, OUT, KV = SHAPES[args.shape]
    if args.side:
        print(json.dumps(side(args.side, args.rows, dtype)))
        return 0
    ways = WAYS + FUSED_WAYS
    best = dict.fromkeys(ways, float("inf"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for r in range(args.rounds):
        for way in ways if r % 2 == 0 else ways[::-1]:
            command = [sys.executable, __file__, "--side", way, "--rows", str(args.rows)]
            command += ["--shape", args.shape]
            out = subprocess.run(
                [*command, "--dtype", args.dtype], capture_output=True, text=True, env=env
            )
            if out.returncode:
                raise RuntimeError(f"{way}: {out.stderr}")
            best[way] = min(best[way], float(out.stdout))
    print(
        f"{args.shape} ({IN} -> {OUT}), {args.dtype}, {args.rows} rows, {SLOTS} adapters of "
        f"rank {RANK}, {MATRICES} matrices"
    )
    for way in ways:
        base = best["fused_base" if way in FUSED_WAYS else "base"]
        print(f"{way:<12} {best[way]:8.3f} ms a pass  {best[way] / base:5.2f}x the base product")
    return 0


if __name__ == "__main__":
    sys.exit(main())
