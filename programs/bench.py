"""Measure speed against transformers and against the hardware limit, in one process.

    python programs/bench.py [--quick] [--size tiny|small|smol] [--only decode,train,...]

Our code and transformers run side by side on the same weights and inputs, in alternating
rounds, and the table reports ratios (on a shared machine absolute numbers are noise; ratios
measured side by side are not). Sections: limit, decode, throughput, prefill, train,
structured, serve, isolated, speculation, window, adapters. Results go to
runs/bench/<timestamp>/ (results.json, results.md, and chart.png when matplotlib is
installed); docs/benchmarks.md explains how to read them. The benchmark itself lives in
programs/benchmark/, outside the astrai package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark package beside it

from benchmark.isa import ISAS, hold
from benchmark.models import SIZES
from benchmark.run import DTYPES, Options, run_bench, summary
from benchmark.sections import SECTIONS


def parse(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, few tokens")
    parser.add_argument("--size", choices=list(SIZES), help="model shape (default small; tiny with --quick)")  # fmt: skip
    parser.add_argument("--only", default="", help=f"comma-separated sections of: {', '.join(SECTIONS)}")  # fmt: skip
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, ...")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="weights and K/V dtype for inference")  # fmt: skip
    parser.add_argument("--quantize", choices=["int8", "int4"], help="our weights in 8 or 4 bits (the transformers reference stays in --dtype)")  # fmt: skip
    parser.add_argument("--rounds", type=int, help="measured rounds per side (default 3; 2 with --quick)")  # fmt: skip
    parser.add_argument("--clients", type=int, help="concurrent streaming clients in serve")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-reference", action="store_true", help="our figures alone, without transformers")  # fmt: skip
    parser.add_argument("--peer", choices=["llama.cpp"], help="add llama.cpp's rows (F32, BF16, Q8_0, Q4_0, Q4_K_M GGUF of the same weights), ours in the same formats beside them; needs the peer extra")  # fmt: skip
    parser.add_argument("--formats", default="", help="with --peer: comma-separated formats of float32, bf16, int8, int4 to pair with llama.cpp's files (default all; the run's own always runs)")  # fmt: skip
    parser.add_argument("--isa", default="native", choices=ISAS, help="avx2: every side as an AVX2-only CPU would run (torch, oneDNN, MKL, fbgemm and our kernels held to AVX2; the peer must be a llama.cpp built without AVX-512)")  # fmt: skip
    parser.add_argument("--out", default="runs/bench", help="where run folders and the cached models go")  # fmt: skip
    args = parser.parse_args(argv)
    hold(args.isa)
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return Options(
        size=args.size,
        quick=args.quick,
        only=tuple(s.strip() for s in args.only.split(",") if s.strip()),
        device=args.device,
        dtype=args.dtype,
        quantize=args.quantize,
        rounds=args.rounds,
        clients=args.clients,
        threads=args.threads,
        reference=not args.no_reference,
        out=Path(args.out),
        peer=args.peer,
        formats=tuple(s.strip() for s in args.formats.split(",") if s.strip()),
    )


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        results = run_bench(opts, log=lambda line: print(line, flush=True))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary(results))
    failed = [name for name, s in results["sections"].items() if s["status"].startswith("failed")]
    refused = [row for row in results["rows"] if row.get("verdict") == "refused"]
    for row in refused:  # a ratio of different work is no figure: the run fails
        print(f"error: {row['section']}: {row['name']}: refused, {row['why']}", file=sys.stderr)
    return 1 if failed or refused else 0


if __name__ == "__main__":
    sys.exit(main())
