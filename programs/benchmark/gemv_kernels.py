"""One product's streaming speed at the Qwen2.5-0.5B matrix shapes, in this process alone.

    python programs/benchmark/gemv_kernels.py PRODUCT [--threads N] [--rows R]

PRODUCT is one of PRODUCTS below. For each shape, enough copies of the matrix to exceed the
last-level cache are multiplied one after the other (as a decode step streams its weights), and
the best of several passes is reported as GB/s of weight bytes read, per second of wall time
and per second of the process's CPU time (on a loaded machine the first counts the waits). "sum" reads float32
tensors of the same bytes with `a.sum()`: what this process can stream at all. Run each product
in its own process, alternating, and compare within one run (a shared machine drifts).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from astrai.infer import int4, quant

SHAPES = ((896, 4864), (4864, 896), (151936, 896), (1152, 896), (9728, 896))
STREAM_BYTES = 96 << 20  # well past a 32 MiB L3


def _float_linear(w):
    return w.shape[0] * w.shape[1] * 4, lambda x: torch.nn.functional.linear(x, w)


def _float_mv(w):
    return w.shape[0] * w.shape[1] * 4, lambda x: torch.mv(w, x[0])


def _packed(w):
    from astrai.infer.packed import pack

    p = pack(w)
    return w.shape[0] * w.shape[1] * 4, p.linear


def _sum(w):
    return w.numel() * 4, lambda x: w.sum()


def _int4(kernel, group):
    def build(w):
        m = int4.int4_matrix(w, kernel, group)
        return w.numel() // 2 + 4 * m.scale.numel(), m.run

    return build


def _int8(kernel):
    def build(w):
        m = quant.int8_matrix(w, kernel)
        return w.numel() + 4 * w.shape[0], m.run

    return build


PRODUCTS = {
    "float32_linear": _float_linear,
    "float32_mv": _float_mv,
    "float32_packed": _packed,
    "sum": _sum,
    **{f"int4_{k}_{g}": _int4(k, g) for k in ("weight_only", "gemv") for g in (32, 128)},
    **{f"int8_{k}": _int8(k) for k in ("weight_only", "dynamic", "gemv")},
}


def streamed_gbps(build, shape, rows: int, passes: int = 5) -> tuple[float, float]:
    """(GB/s of wall time, GB/s of this process's CPU time): on a machine shared with other
    work the CPU time is this process's own cost, the wall time also the time it waited."""
    w = torch.randn(shape) * 0.02
    nbytes, run = build(w)
    runs = [run] + [build(torch.randn(shape) * 0.02)[1] for _ in range(STREAM_BYTES // nbytes)]
    x = torch.randn(rows, shape[1])
    for r in runs:
        r(x)
    wall = cpu = float("inf")
    for _ in range(passes):
        start, start_cpu = time.perf_counter(), time.process_time()
        for r in runs:
            r(x)
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    streamed = nbytes * len(runs) / 1e9
    return round(streamed / wall, 2), round(streamed / cpu, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("product", choices=sorted(PRODUCTS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--shapes", default="all", help="comma-separated OUTxIN, or all")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = SHAPES
    if args.shapes != "all":
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    build = PRODUCTS[args.product]
    result = {f"{o}x{i}": streamed_gbps(build, (o, i), args.rows) for o, i in shapes}
    print(
        json.dumps({"product": args.product, "threads": args.threads, "rows": args.rows, **result})
    )


if __name__ == "__main__":
    main()
