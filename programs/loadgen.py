"""Serving benchmark on realistic traffic: a load generator, in its own process, streaming
requests over HTTP to a real `just serve` process.

    just bench-serve                     # mixed and shared-prefix workloads, the small model
    just bench-serve --quick             # a smoke run: tiny model, few and short requests
    just bench-serve --workloads shared --rates 1,2,inf --variants engine,no-prefix-cache
    just bench-serve --workloads grounded,mixed --variants engine,lookup

Each workload (mixed lengths; a shared 1,000-token system prompt; grounded: quoting a given
document) is sent at several Poisson
arrival rates and all at once, to the engine as served and to references on the very same
requests: the engine without the prefix cache, without chunked prefill, with prompt lookup
(`--speculative lookup`), and transformers
static batching (its own process). Results go to runs/bench-serve/<timestamp>/:
results.json, results.md and one PNG per workload. docs/benchmarks.md explains the workloads
and how to read the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # load/, benchmark/ and figures beside it

from benchmark.models import SIZES
from load.client import Outcome, send_all
from load.metrics import Objective, accounting, summarize
from load.server import IDLE_KEYS, MODEL_NAME, idle_stats, serve_process
from load.workloads import DEFAULT_SHAPES, WORKLOADS, Job, Shape, make_workload

INF = float("inf")
QUICK_SHAPES = {
    "mixed": Shape(32, 256, 64),
    "shared": Shape(16, 1000, 16),
    "grounded": Shape(16, 256, 64),
}

# name -> (serve flags, workloads it is measured on); "transformers" is the static reference
VARIANTS = {
    "engine": ([], WORKLOADS),
    "no-prefix-cache": (["--no-prefix-cache"], ("shared",)),
    "no-chunked-prefill": (["--no-chunked-prefill"], ("mixed",)),
    "lookup": (["--speculative", "lookup"], ("grounded", "mixed")),
    "transformers": (None, ("mixed",)),
}
REFERENCE_RATES = {"transformers": (INF,)}  # static batching: all at once only (minutes each)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny model, 32 mixed / 16 shared short requests")  # fmt: skip
    p.add_argument("--size", choices=list(SIZES), help="model shape (default small; tiny with --quick)")  # fmt: skip
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: mixed, shared, grounded")  # fmt: skip
    p.add_argument("--rates", default="auto", help="requests/s, comma-separated, inf = all at once; auto: all at once, then 1/4, 1/2 and 3/4 of the rate it achieved")  # fmt: skip
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of: {', '.join(VARIANTS)}")  # fmt: skip
    p.add_argument("--requests", type=int, help="requests per workload (default 256 mixed, 64 shared)")  # fmt: skip
    p.add_argument("--prompt-max", type=int, help="mixed: longest prompt (default 1024; the median scales with it)")  # fmt: skip
    p.add_argument("--output-max", type=int, help="mixed: longest output (default 512; the median scales with it)")  # fmt: skip
    p.add_argument("--max-batch", type=int, default=32, help="the engine's max_batch, also B of static batching")  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: time to first token objective")  # fmt: skip
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput: time per output token objective (after the first)")  # fmt: skip
    p.add_argument("--serve-args", default="", help='more `just serve` flags for every server, e.g. "--prefill-chunk-decoding 32"')  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench-serve", help="where run folders and the model go")  # fmt: skip
    args = p.parse_args(argv)
    args.size = args.size or ("tiny" if args.quick else "small")
    for name in ("workloads", "variants"):
        chosen = [s.strip() for s in getattr(args, name).split(",") if s.strip()]
        known = WORKLOADS if name == "workloads" else tuple(VARIANTS)
        unknown = [c for c in chosen if c not in known]
        if unknown:
            p.error(f"--{name}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
        setattr(args, name, chosen)
    if args.rates != "auto":
        try:
            args.rates = [float(r) for r in args.rates.split(",")]
        except ValueError:
            p.error(f"--rates: numbers or inf, comma-separated, got {args.rates!r}")
        if any(not r > 0 for r in args.rates):
            p.error("--rates must be positive")
    return args


def shapes(args) -> dict[str, Shape]:
    base = QUICK_SHAPES if args.quick else DEFAULT_SHAPES
    out = {}
    for name, shape in base.items():
        if args.requests:
            shape = dataclasses.replace(shape, requests=args.requests)
        if name == "mixed" and args.prompt_max:
            shape = dataclasses.replace(shape, prompt_max=args.prompt_max)
        if name == "mixed" and args.output_max:
            shape = dataclasses.replace(shape, output_max=args.output_max)
        out[name] = shape
    return out


def served_model(root: Path, size: str) -> tuple[Path, int]:
    """The benchmark's random-weight model folder with a word-level tokenizer saved beside it
    (no special tokens: every id is text and nothing ends a completion early)."""
    from benchmark.models import bench_tokenizer, model_folder

    folder = model_folder(root, size)
    vocab = SIZES[size]["vocab_size"]
    if not (folder / "tokenizer.json").exists():
        bench_tokenizer(vocab).save_pretrained(folder)
    return folder, vocab


def warm_up(url: str, vocab: int) -> None:
    """A few requests, so the measured run pays no first-call costs."""
    jobs = [Job(i, [(7 * i + k) % vocab for k in range(24 + 40 * i)], 8, 0.0) for i in range(4)]
    send_all(url, MODEL_NAME, jobs)


def check_idle(before: dict, after: dict, jobs: list[Job], outcomes: list[Outcome]) -> dict:
    """The server's books: at idle it holds what it held before, and it finished exactly
    the requests sent, with exactly the tokens asked for."""
    return {
        "idle_equal": all(before[k] == after[k] for k in IDLE_KEYS),
        "finished_delta": after["requests_finished"] - before["requests_finished"],
        "completion_tokens_delta": after["completion_tokens"] - before["completion_tokens"],
        "completion_tokens_asked": sum(job.output_len for job in jobs),
        "requests_sent": len(jobs),
    }


def run_served(url: str, jobs: list[Job], slo: Objective) -> dict:
    before = idle_stats(url)
    wall, outcomes = send_all(url, MODEL_NAME, jobs)
    after = idle_stats(url)
    return {
        "figures": summarize(jobs, outcomes, wall, slo),
        "accounting": accounting(jobs, outcomes) | check_idle(before, after, jobs, outcomes),
        "stats_after": after,
    }


def run_static(folder: Path, jobs: list[Job], batch: int, slo: Objective, tmp: Path) -> dict:
    spec, out = tmp / "static-spec.json", tmp / "static-out.json"
    spec.write_text(json.dumps({"model": str(folder), "batch": batch, "jobs": [dataclasses.asdict(j) for j in jobs]}))  # fmt: skip
    script = Path(__file__).resolve().parent / "load" / "static_batching.py"
    subprocess.run([sys.executable, str(script), str(spec), str(out)], check=True)
    result = json.loads(out.read_text())
    outcomes = [Outcome(**o) for o in result["outcomes"]]
    return {
        "figures": summarize(jobs, outcomes, result["wall_s"], slo),
        "accounting": accounting(jobs, outcomes),
    }


def auto_rates(achieved: float) -> list[float]:
    return [round(achieved * f, 3) for f in (0.25, 0.5, 0.75)]


def run_variant(variant, args, folder, vocab, shape_of, rates_of, slo, run_dir, log):
    """Every (workload, rate) of one variant, on one server process (or the reference)."""
    flags, workloads = VARIANTS[variant]
    runs = []
    todo = [w for w in args.workloads if w in workloads]
    if not todo:
        return runs

    def measure(url, workload, rate):
        jobs = make_workload(workload, shape_of[workload], vocab, rate, args.seed)
        if url is None:
            with tempfile.TemporaryDirectory() as tmp:
                result = run_static(folder, jobs, args.max_batch, slo, Path(tmp))
        else:
            result = run_served(url, jobs, slo)
        run = {"workload": workload, "variant": variant, "rate": rate, **result}
        f = result["figures"]
        log(f"  {workload:6} {variant:18} {_rate(rate):>11}: {f['output_tok_s']:8.1f} tok/s "
            f"{f['requests_s']:6.2f} req/s  TTFT p50 {f['ttft_p50_ms']:8.1f} ms  "
            f"TPOT p50/p99 {f['tpot_p50_ms']:6.1f}/{f['tpot_p99_ms']:7.1f} ms  "
            f"hand-over gap p99 {f['handover_p99_ms']:7.1f} ms  "
            f"e2e p99 {f['e2e_p99_ms']:8.1f} ms  good {f['good_fraction']:.0%}")  # fmt: skip
        return run

    def all_rates(url):
        for workload in todo:
            rates = REFERENCE_RATES.get(variant) or rates_of.get(workload)
            if rates is None:  # auto: all at once first, then fractions of what it achieved
                runs.append(measure(url, workload, INF))
                achieved = runs[-1]["figures"]["requests_s"]
                rates_of[workload] = [INF, *auto_rates(achieved)]
                rates = rates_of[workload][1:]
            for rate in rates:
                runs.append(measure(url, workload, rate))

    if flags is None:
        all_rates(None)
        return runs
    server_flags = ["--max-batch", str(args.max_batch), "--max-waiting", "0", *flags]
    server_flags += shlex.split(args.serve_args)
    with serve_process(folder, server_flags, run_dir / f"serve-{variant}.log") as url:
        warm_up(url, vocab)
        all_rates(url)
    return runs


def _rate(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g}/s"


def run_bench(args, log=print) -> dict:
    root = Path(args.out)
    run_dir = root / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    folder, vocab = served_model(root, args.size)
    shape_of = shapes(args)
    slo = Objective(args.slo_ttft_ms, args.slo_tpot_ms)
    # explicit rates, or (auto) found by the first variant and reused by the others, so
    # every variant serves the same arrivals
    rates_of: dict[str, list[float]] = (
        {} if args.rates == "auto" else {w: args.rates for w in args.workloads}
    )
    log(f"serving benchmark: {args.size} model, max_batch {args.max_batch}, workloads "
        f"{', '.join(args.workloads)}; results in {run_dir}")  # fmt: skip
    runs = []
    for variant in args.variants:
        runs += run_variant(variant, args, folder, vocab, shape_of, rates_of, slo, run_dir, log)
    results = {
        "config": {
            "size": args.size,
            "max_batch": args.max_batch,
            "serve_args": args.serve_args,
            "seed": args.seed,
            "shapes": {k: dataclasses.asdict(v) for k, v in shape_of.items()},
            "objective": dataclasses.asdict(slo),
        },
        "runs": runs,
    }
    (run_dir / "results.json").write_text(json.dumps(results, indent=1))
    (run_dir / "results.md").write_text(markdown(results))
    try:
        from load.plots import draw

        for path in draw(results, run_dir):
            log(f"drew {path}")
    except RuntimeError as exc:  # NoMatplotlib
        log(str(exc))
    results["run_dir"] = str(run_dir)
    return results


COLUMNS = [
    ("output tok/s", "output_tok_s"), ("req/s", "requests_s"), ("goodput req/s", "goodput_requests_s"),
    ("TTFT p50 / p90 / p99 ms", "ttft"), ("TPOT p50 / p90 / p99 ms", "tpot"),
    ("hand-over gap p50 / p90 / p99 ms", "handover"), ("e2e p50 / p90 / p99 ms", "e2e"),
]  # fmt: skip


def markdown(results: dict) -> str:
    """One table row per (workload, variant, rate)."""
    head = ["workload", "variant", "rate", *(title for title, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in results["runs"]:
        f = run["figures"]
        cells = [run["workload"], run["variant"], _rate(run["rate"])]
        for _, key in COLUMNS:
            if key in f:
                cells.append(f"{f[key]:,.2f}")
            else:
                cells.append(" / ".join(f"{f[f'{key}_p{q}_ms']:,.0f}" for q in (50, 90, 99)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def problems(results: dict) -> list[str]:
    """Runs whose books do not balance."""
    bad = []
    for run in results["runs"]:
        acc = run["accounting"]
        name = f"{run['workload']} {run['variant']} {_rate(run['rate'])}"
        if acc["failed"] or acc["wrong_token_count"]:
            bad.append(
                f"{name}: failed {acc['failed'][:5]}, wrong token count {acc['wrong_token_count'][:5]}"
            )
        if "idle_equal" in acc and not (
            acc["idle_equal"]
            and acc["finished_delta"] == acc["requests_sent"]
            and acc["completion_tokens_delta"] == acc["completion_tokens_asked"]
        ):
            bad.append(f"{name}: server books {acc}")
    return bad


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    results = run_bench(args, log=lambda line: print(line, flush=True))
    bad = problems(results)
    for line in bad:
        print(f"error: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
