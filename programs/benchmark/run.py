"""One benchmark run: both sides load one weights folder, the chosen sections run, and
results.json, results.md and (with matplotlib) chart.png are written to <out>/<timestamp>/."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from figures import NoMatplotlib

import astrai
from astrai.model import DTYPES
from astrai.train.matmul_peak import cpu_model

from . import peer_llamacpp
from .chart import Panel, write_chart
from .formats import FORMATS, Format, format_of, quantize_skip_reason
from .isa import HELD, held_isa
from .models import FULL, QUICK, SIZES, bench_tokenizer, has_transformers, model_folder
from .report import MARKS, markdown, table, verdicts
from .sections import SECTIONS, Bench, limit_rows


@dataclass(frozen=True)
class Options:
    size: str | None = None  # None: "tiny" with quick, else "small"
    quick: bool = False
    only: tuple[str, ...] = ()  # () = every section
    device: str = "auto"
    dtype: str = "float32"
    quantize: str | None = None  # our side's weights ("int8"); the reference stays in dtype
    rounds: int | None = None
    clients: int | None = None
    threads: int | None = None
    reference: bool = True
    out: Path = Path("runs/bench")
    peer: str | None = None  # "llama.cpp": its rows next to ours (peer_llamacpp.py)
    formats: tuple[str, ...] = ()  # with the peer: the formats paired (formats.FORMATS); () all


def selected_sections(only: tuple[str, ...]) -> list[str]:
    """The sections to run, in their fixed order; decode, throughput and prefill bring the
    limits they are measured against."""
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    wanted = set(only or SECTIONS)
    if wanted & {"decode", "throughput", "prefill"}:
        wanted.add("limit")
    return [name for name in SECTIONS if name in wanted]


def wanted_formats(names: tuple[str, ...], main: Format) -> tuple[str, ...]:
    """The formats of formats.FORMATS a run with the peer measures: those named (all when none
    are) and always the run's own (`main`, from --dtype / --quantize)."""
    known = [f.name for f in FORMATS]
    if unknown := sorted(set(names) - set(known)):
        raise ValueError(f"unknown format(s) {unknown}; choose from {', '.join(known)}")
    return tuple(n for n in known if not names or n in names or n == main.name)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def run_bench(opts: Options, log: Callable[[str], None] = print) -> dict:
    """Run the benchmark; returns what results.json holds (plus "run_dir", and "chart":
    whether chart.png was drawn)."""
    sections = selected_sections(opts.only)
    formats = wanted_formats(opts.formats, format_of(opts.dtype, opts.quantize))
    if opts.threads:
        torch.set_num_threads(opts.threads)
    size = opts.size or ("tiny" if opts.quick else "small")
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if opts.quantize and (why := quantize_skip_reason(opts.quantize)):
        raise ValueError(f"--quantize {opts.quantize}: {why}")
    work = QUICK if opts.quick else FULL
    overrides = {"rounds": opts.rounds, "clients": opts.clients}
    work = dataclasses.replace(work, **{k: v for k, v in overrides.items() if v is not None})
    device, dtype = pick_device(opts.device), DTYPES[opts.dtype]
    folder = model_folder(Path(opts.out), size)
    params, cfg = astrai.load_pretrained(folder, dtype=dtype, device=device)
    reference, missing = _load_reference(folder, dtype, device, opts.reference)
    if reference is None:
        log(f"no reference: {missing}; the figures are ours alone")
    tokenizer = bench_tokenizer(cfg.vocab_size)
    b = Bench(size, work, device, dtype, folder, params, cfg, tokenizer, reference, log)
    b.quantize = opts.quantize
    b.wanted_formats = formats
    if (isa := held_isa()) != "native":
        b.note(f"--isa {isa}: {', '.join(f'{k}={v}' for k, v in HELD[isa].items())}")
    status = {}
    try:
        if opts.peer:
            b.peer = peer_llamacpp.start_for_bench(b)
        if b.peer is not None:
            b.choose_formats()
        for name in sections:
            status[name] = _run_section(b, name, log)
    finally:
        if b.engine is not None:
            b.engine.close()
        if b.peer is not None:
            peer_llamacpp.close_peer(b.peer)
    limit_rows(b)
    order = list(SECTIONS)
    b.rows.sort(key=lambda row: order.index(row["section"]) if row["section"] in order else 0)
    results = {
        "meta": _meta(opts, size, work, device, dtype, cfg, folder, missing),
        "sections": status,
        "rows": b.rows,
        **b.extra,
    }
    run_dir = _new_run_dir(Path(opts.out))
    _write(run_dir, results)
    ours_dtype = opts.dtype + (f", ours {opts.quantize}" if opts.quantize else "")
    title = f"AstrAI bench: {size} model, {device}, {ours_dtype}, {results['meta']['time']}"
    try:
        write_chart(run_dir / "chart.png", title, chart_panels(b.rows))
        chart = True
    except NoMatplotlib as exc:  # the figures are in results.json all the same
        log(str(exc))
        chart = False
    return {**results, "run_dir": str(run_dir), "chart": chart}


def _run_section(b: Bench, name: str, log) -> dict:
    log(f"== {name}")
    start = time.perf_counter()
    try:
        SECTIONS[name](b)
        state = "ok"
    except ImportError as exc:
        state = f"skipped: {exc}"
        log(state)
    except Exception as exc:  # one broken section must not lose the others' figures
        state = f"failed: {type(exc).__name__}: {exc}"
        log(traceback.format_exc())
        log(state)
    return {"status": state, "seconds": round(time.perf_counter() - start, 1)}


def _load_reference(folder: Path, dtype, device, wanted: bool):
    if not wanted:
        return None, "turned off with --no-reference"
    if not has_transformers():
        return None, "transformers is not installed"
    from .reference import load_reference

    return load_reference(folder, dtype, device), ""


def _new_run_dir(root: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir, k = root / stamp, 1
    while run_dir.exists():
        run_dir, k = root / f"{stamp}-{k}", k + 1
    run_dir.mkdir(parents=True)
    return run_dir


def _meta(opts, size, work, device, dtype, cfg, folder, missing) -> dict:
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "size": size,
        "quick": opts.quick,
        "device": str(device),
        "device_name": _device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "quantize": opts.quantize,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers_version,
        "reference_missing": missing or None,
        "commit": _commit(),
        "model_folder": str(folder),
        "model": msgspec.to_builtins(cfg),
        "workload": dataclasses.asdict(work),
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def _write(run_dir: Path, results: dict) -> None:
    rows = results["rows"]
    (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    skipped = [
        f"- {s['section']}: {s['name']}: skipped: {s['why']}" for s in results.get("skipped", [])
    ]
    (run_dir / "results.md").write_text("\n".join([markdown(rows), "", *skipped]).rstrip() + "\n")


def chart_panels(rows: list[dict]) -> list[Panel]:
    """Ratios against their references, and decode speed as a share of the roofline."""
    ratios = [
        (f"{r['section']}: {r['name']}" + ("" if r["reference_name"] == "transformers"
         else f" vs {r['reference_name']}") + MARKS.get(r.get("verdict"), ""), r["ratio"],
         r["target"])
        for r in rows
        if r.get("ratio") is not None
    ]  # fmt: skip
    shares = [
        (r["name"].removesuffix(", share of roofline"), r["ours"], r["target"])
        for r in rows
        if r["unit"] == "%"
    ]
    return [
        Panel(
            "Speed against the reference on the same weights and inputs",
            ratios, 1.0, "same speed (1.0x)", "ours / reference, tokens per second (x)", "{:.2f}x",
        ),
        Panel(
            "Decoding speed against the hardware limit (memory or compute roofline)",
            shares, 100.0, "the roofline (100 %)", "share of the roofline (%)", "{:.0f} %",
        ),
    ]  # fmt: skip


def summary(results: dict) -> str:
    """What the terminal shows at the end of a run."""
    lines = [table(results["rows"]), "", *verdicts(results["rows"])]
    for note in results.get("notes", []):
        lines.append(note)
    for s in results.get("skipped", []):
        lines.append(f"{s['section']}: {s['name']}: skipped: {s['why']}")
    for name, state in results["sections"].items():
        if state["status"] != "ok":
            lines.append(f"{name}: {state['status']}")
    files = "results.json, results.md" + (", chart.png" if results.get("chart") else "")
    lines.append(f"results: {results['run_dir']}/{files}")
    return "\n".join(lines)
