"""The measured sections. Each takes the run's Bench, measures our side and the reference in
interleaved rounds on the same inputs, and appends rows. The pieces of AstrAI are imported
when a section first uses them, so one that cannot be imported raises ImportError, which the
runner reports as skipped."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import combinations, product, zip_longest
from pathlib import Path

import torch

from astrai.config import ModelConfig

from . import ours, reference
from .formats import (
    FORMATS,
    PEER_TYPES,
    Format,
    arithmetic_of,
    bf16_skip_reason,
    format_of,
    peer_pairs,
    skip_reason,
)
from .limits import (
    ARITHMETIC,
    compute_peak,
    decode_bytes_per_token,
    decode_flops_per_token,
    gguf_bytes_per_token,
    int8_matmul_gops,
    matmul_gflops,
    mean_kv_bytes,
    prompt_flops_per_token,
    roofline_fraction,
    roofline_tokens_per_s,
    round_roofline,
    stream_bandwidth,
    weights_read_bandwidth,
    weights_reader,
)
from .models import Workload, random_prompts
from .peer_llamacpp import generate_calls, prefill_calls, release
from .report import compare, figure
from .timing import interleave, median, timed
from .verify import Logits, agreement, forward_logits, generated, predicted, same_work, verdict

# 2x transformers' batched generate, in float32 and bf16. The earlier 3x / 5x are out of
# reach on a CPU: at 64 rows our bf16 products already run near the matmul peak (~725
# GFLOP/s on 2 Zen 4 cores) and take 57 % of a step (docs/benchmarks.md, Targets).
THROUGHPUT_TARGETS = {16: 2.0, 64: 2.0}
# Against llama.cpp, on the shapes people run, by llama.cpp's file at the same bits: batch-1
# decoding at least as fast (8-bit 1.1x, Q4_K_M's larger file 0.9x), prompts and sixteen
# requests 1.5x.
PEER_TARGETS = {
    "decode": {"F32": 1.0, "BF16": 1.0, "Q8_0": 1.1, "Q4_0": 1.0, "Q4_K_M": 0.9},
    "prefill": dict.fromkeys(PEER_TYPES, 1.5),
    "throughput 16": dict.fromkeys(PEER_TYPES, 1.5),
}
PEER_TARGET_SIZES = ("q05", "1b")
# The batch-1 rows read the memory's bandwidth once a round beside the sides' rounds, over a
# working set the size of the largest side's weights up to READ_CAP: far past any cache seen
# (480 MiB of L3 at most), without holding a float32 1B's 5 GB beside the sides' processes.
MEMORY, READ_CAP = "memory bandwidth", 1 << 30
TRAIN_HYPER = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "max_grad_norm": 1.0}
# Which of our forwards rounds as each side does (verify.py): "ours" in the run's dtype with
# --quantize, "float" in the run's dtype. A side not named (llama.cpp) cannot be reproduced.
ROUNDS_LIKE = {
    **dict.fromkeys(("engine", "loop", "prefill", "http", "direct", "serve"), "ours"),
    **dict.fromkeys(("transformers", "forward", "ref_forward", "ref_prefill"), "float"),
}


@dataclass
class Bench:
    """Everything one run shares: the model on both sides, the workload, and what was found."""

    size: str
    work: Workload
    device: torch.device
    dtype: torch.dtype
    folder: Path
    params: dict
    cfg: ModelConfig
    tokenizer: object
    reference: object | None  # transformers model, or None when transformers is missing
    log: Callable[[str], None]
    rows: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    shares: list = field(default_factory=list)  # (section, batch, rates, target) for limit_rows
    engine: object | None = None
    peer: object | None = None  # the llama.cpp peer (peer_llamacpp.Peer) with --peer llama.cpp
    quantize: str | None = None  # our weights in 8 bits ("int8"); the reference stays in dtype
    forwards: dict = field(default_factory=dict)  # precision -> our forward's Logits
    # with the peer: the formats our side runs in besides the run's own ({name: Format}), so
    # that each llama.cpp file has ours at the same bits (formats.py)
    formats: dict[str, Format] = field(default_factory=dict)
    skipped_formats: dict[str, str] = field(default_factory=dict)  # format name -> why not
    wanted_formats: tuple[str, ...] = tuple(f.name for f in FORMATS)  # --formats

    @property
    def main_format(self) -> Format:
        return format_of(str(self.dtype).removeprefix("torch."), self.quantize)

    def choose_formats(self) -> None:
        """With the peer: every format of formats.FORMATS besides the run's own that runs here,
        and a line for each that does not, saying why."""
        main = self.main_format
        for f in FORMATS:
            if f == main or f.name not in self.wanted_formats:
                continue
            reason = skip_reason(f, self.device)
            if reason is None:
                self.formats[f.name] = f
            else:
                self.skipped_formats[f.name] = reason
                self.skip("formats", f"ours in {f.name}", reason)

    def skip(self, section: str, name: str, why: str) -> None:
        """A measurement that does not run here, and why; printed and kept in the JSON."""
        self.extra.setdefault("skipped", []).append({"section": section, "name": name, "why": why})
        self.log(f"{section}: {name}: skipped: {why}")

    def format_spec(self, f: Format) -> tuple[torch.dtype, str | None]:
        """(dtype, quantize) of our side in format f: 8- and 4-bit weights keep the run's
        dtype for activations and K/V, as --quantize does."""
        return (getattr(torch, f.dtype) if f.dtype else self.dtype), f.quantize

    def rounding_of(self, side: str) -> Logits | None:
        """Our forward that rounds as `side` does (verify.py); None for a side not ours."""
        if side in ROUNDS_LIKE:
            return self.logits_in(ROUNDS_LIKE[side])
        fmt = side.rpartition(" ")[2]
        if fmt in self.formats and side.partition(" ")[0] in ROUNDS_LIKE:
            return self.logits_in(f"format {fmt}")
        return None

    def prompts(self, n: int, seed: int) -> list[list[int]]:
        return random_prompts(n, self.work.prompt_len, self.cfg.vocab_size, seed)

    def logits_in(self, precision: str) -> Logits:
        """Our forward's logits in a precision: "exact" (float64 weights), "float" (the run's
        dtype), "ours" (the run's dtype with --quantize), "format F"; its weights made on
        first use. Besides the exact one only the last precision's weights are kept: a row is
        checked against the exact forward and its side's rounding, and at the 1B shape the
        exact weights (10 GB) and every format's beside them outgrew a 23 GB machine."""

        def logits(feed: tuple[int, ...]):
            if precision not in self.forwards:
                for other in [p for p in self.forwards if p != "exact"]:
                    del self.forwards[other]
                self.forwards[precision] = forward_logits(self._weights(precision), self.cfg)
            return self.forwards[precision](feed)

        return logits

    def _weights(self, precision: str) -> dict:
        if precision.startswith("format "):
            dtype, quantize = self.format_spec(self.formats[precision.removeprefix("format ")])
            params = {
                k: v.to(dtype) if v.is_floating_point() else v for k, v in self.params.items()
            }
            return ours.prepared(params, self.cfg, quantize)
        if precision == "exact":
            from astrai import load_pretrained

            return load_pretrained(self.folder, dtype=torch.float64, device=self.device)[0]
        if precision == "ours" and self.quantize:
            return ours.prepared(self.params, self.cfg, self.quantize)
        return self.params

    def note(self, text: str) -> None:
        """Something the reader of the results should know; printed and kept in the JSON."""
        self.extra.setdefault("notes", []).append(text)
        self.log(text)

    def measure(
        self, calls: dict[str, Callable], inputs: list, units: float, outputs=None, warm_up=True,
        keep=lambda out: out, beside: dict[str, Callable[[], float]] | None = None,
    ) -> dict[str, list[float]]:  # fmt: skip
        """Warm every call up on inputs[0], then time each on inputs[r + 1] in interleaved
        rounds, one per input after the first -> {name: [units/s per round]}. outputs, when
        given, collects keep(what each call returned), taken after the timing, as
        outputs[name][round]; units/s takes each call for the units of work, which the rows'
        verification checks (verify.py). beside: figures read once a round between the
        calls, {name: [figure per round]} in the result too (the memory's bandwidth)."""
        for call in calls.values() if warm_up else ():
            call(inputs[0])  # first calls pay for thread pools and allocator growth

        def side(name, call):
            def run(r):
                seconds, out = timed(lambda: call(inputs[r + 1]), self.device)
                if outputs is not None:
                    outputs.setdefault(name, {})[r] = keep(out)
                return units / seconds

            return run

        sides = {name: side(name, call) for name, call in calls.items()}
        sides |= {name: lambda r, read=read: read() for name, read in (beside or {}).items()}
        return interleave(sides, len(inputs) - 1)


def engine_of(b: Bench):
    """The run's in-process Engine, made on first use and shared by structured and serve."""
    if b.engine is None:
        b.engine = ours.make_engine(
            b.params, b.cfg, b.tokenizer, b.work, b.device, b.dtype, b.quantize
        )
        _note_kernels(b, b.engine.kernels)
    return b.engine


def _note_kernels(b: Bench, kernels: dict[str, int], fmt: str = "") -> None:
    """The products an Engine chose (int8 and int4 by timing at load, so the rows say what
    ran), once: the run's own format as results' "kernels", another `fmt` under
    "kernels_by_format"."""
    chosen, key = (
        (b.extra.setdefault("kernels_by_format", {}), fmt) if fmt else (b.extra, "kernels")
    )
    if key not in chosen:
        chosen[key] = kernels
        shown = ", ".join(f"{n} {kind}" for kind, n in kernels.items())
        b.note(f"our matrix products{', ' + fmt if fmt else ''}: {shown}")


@contextlib.contextmanager
def sides(b: Bench, names: tuple[str, ...]) -> Iterator[dict[str, Callable]]:
    """{name: generate(prompts, new_tokens)} for the named sides ("engine", "loop",
    "transformers"), each in a process of its own (benchmark/isolated.py): a side measured
    next to another's threads would pay for them. transformers only when it is installed."""
    from .isolated import side_processes

    base = {
        "folder": str(b.folder),
        "device": str(b.device),
        "dtype": str(b.dtype).removeprefix("torch."),
        "quantize": b.quantize,
        "workload": dataclasses.asdict(b.work),
    }
    wanted = [n for n in names if n != "transformers" or b.reference is not None]
    specs = {name: {**base, "side": name} for name in wanted}
    for name in names:
        side, _, fmt = name.partition(" ")
        if fmt:  # "engine int8": the Engine with its weights in another format
            dtype, quantize = b.format_spec(b.formats[fmt])
            dtype_name = str(dtype).removeprefix("torch.")
            specs[name] = {**base, "side": side, "dtype": dtype_name, "quantize": quantize}
    with side_processes(specs, torch.get_num_threads()) as processes:
        for name, process in processes.items():
            side, _, fmt = name.partition(" ")
            if side == "engine":
                _note_kernels(b, process.facts["kernels"], fmt)
        yield {name: process.generate for name, process in processes.items()}


def format_groups(
    b: Bench, names: tuple[str, ...]
) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(our sides, llama.cpp files) of names and the peer's files, in the groups measured one
    after another: the run's own format with the sides that have no other (the loop,
    transformers) and llama.cpp's files at its bits, then each other format of ours with the
    files at its bits, then any file no format of ours pairs with. Only a group's processes and
    llama.cpp models are alive while it is measured: at the 1B shape the five formats of both
    sides together need more memory than a 23 GB machine has, and where the host reclaims a
    VM's memory a side timed beside others' resident gigabytes pays for them. A row's two
    sides are always in one group, so each ratio is still of rounds taken in turn."""
    peers = b.peer.names if b.peer is not None else ()
    groups, paired = [], set()
    for f in (b.main_format, *b.formats.values()):
        ours_names = tuple(
            n for n in names if (n.partition(" ")[2] or b.main_format.name) == f.name
        )
        files = tuple(p for p in peers if p.split()[-1] in f.peers)
        groups.append((ours_names, files))
        paired.update(files)
    if rest := tuple(p for p in peers if p not in paired):
        groups.append(((), rest))
    return [group for group in groups if group != ((), ())]


def by_format(b: Bench, names: tuple[str, ...], n: int) -> Iterator[dict[str, Callable]]:
    """{side: batch of prompts -> n greedy tokens each} for each group of format_groups in turn,
    ours and llama.cpp's; a group's processes end and its llama.cpp models close before the
    next group's start."""
    for ours_names, files in format_groups(b, names):
        limit(b)  # before the group's processes hold their memory
        with sides(b, ours_names) as generate:
            calls = {k: lambda batch, f=f: f(batch, n) for k, f in generate.items()}
            yield calls | generate_calls(b.peer, n, files)
        release(b.peer, files)


def with_formats(b: Bench, side: str) -> tuple[str, ...]:
    """side and, with the peer, the same side in each other format that runs here."""
    return (side, *(f"{side} {fmt}" for fmt in b.formats))


def _available(b: Bench, calls: dict) -> dict:
    """The calls without the reference's ("transformers", "ref_...") when it is missing."""
    if b.reference is not None:
        return calls
    return {k: v for k, v in calls.items() if k != "transformers" and not k.startswith("ref_")}


def _reference_rows(
    b: Bench, section, rates, pairs, unit, targets=None, choices=None, against_peer=0,
    peer_targets=None,
) -> None:  # fmt: skip
    """A compare row per (ours, reference, label), or our figure alone without a reference,
    and a row of pairs[against_peer]'s side against each llama.cpp file. Targets are set for
    the real shapes (the tiny smoke model has none), peer_targets ({llama.cpp file type:
    target}) for the shapes of PEER_TARGET_SIZES."""
    for mine, theirs, label in pairs:
        target = (targets or {}).get(mine) if b.size != "tiny" else None
        if theirs in rates:
            pair = (mine, theirs)
            b.rows.append(_compared(b, section, label, unit, rates, pair, choices, target=target))
        else:
            row = figure(section, label, unit, median(rates[mine]), rates[mine])
            b.rows.append(row | {"sides": [mine]})
    if b.peer is None:
        return
    mine, _, label = pairs[against_peer]
    ours_by_format = {b.main_format.name: mine}
    ours_by_format |= {fmt: f"{mine} {fmt}" for fmt in b.formats if f"{mine} {fmt}" in rates}
    peer_targets = (peer_targets or {}) if b.size in PEER_TARGET_SIZES else {}
    for ours_side, name in peer_pairs(ours_by_format, b.peer.names):
        fmt = ours_side.removeprefix(mine).strip() or b.main_format.name
        pair, target = (ours_side, name), peer_targets.get(name.split()[-1])
        name_vs = f"{label}, {fmt} vs {name}"
        b.rows.append(_compared(b, section, name_vs, unit, rates, pair, choices, name, target))
    paired = {name for _, name in peer_pairs(ours_by_format, b.peer.names)}
    for name in b.peer.names:
        if name not in paired:
            b.rows.append(_peer_alone(b, section, label, unit, rates[name], name))


def _peer_alone(b: Bench, section, label, unit, rates: list[float], name: str) -> dict:
    """llama.cpp's figure for a file whose format our side does not run here, with the reason."""
    fmt = next((f.name for f in FORMATS if name.split()[-1] in f.peers), None)
    why = b.skipped_formats.get(fmt, f"no format of ours matches {name}")
    return {
        "section": section, "name": f"{label}, {fmt or '-'} vs {name}", "unit": unit,
        "ours": None, "ours_rounds": [], "reference": median(rates), "reference_rounds": rates,
        "reference_name": name, "ratio": None, "ratio_range": None, "target": None,
        "met": None, "skipped": why, "sides": [None, name],
    }  # fmt: skip


def _compared(
    b: Bench, section, label, unit, rates, pair, choices=None, reference_name="transformers",
    target=None, greedy=True,
) -> dict:  # fmt: skip
    """A compare row of the pair of sides (ours, theirs), verified (verify.py) when their
    choices are given: the same work, and, for greedy sides, their agreement and whether
    rounding explains where they part. A row whose sides did different work is refused: it
    keeps no ratio."""
    mine, theirs = pair
    row = compare(section, label, unit, rates[mine], rates[theirs], reference_name, target)
    row["sides"] = list(pair)
    if choices is None:
        return row
    if greedy:
        rounded = tuple(b.rounding_of(s) for s in pair)
        row |= verdict(pair, (choices[mine], choices[theirs]), b.logits_in("exact"), rounded)
    else:
        row |= same_work(pair, choices[mine], choices[theirs])
    if row["verdict"] in ("not comparable", "refused"):
        # a target is met by a ratio of like things only; an unchecked row's sides did the
        # same work and ours is explained by its rounding, only the peer's cannot be checked
        row["met"] = None
    if row["verdict"] == "refused":
        row |= {"ratio": None, "ratio_range": None}
    return row


def _choices(batches: list[list[list[int]]], outputs: dict, make=generated) -> dict:
    """{side: [Choices]} of the measured rounds (outputs[side][round]: what each prompt of
    batches[round + 1] got; a prompt without an answer gets none, an answer without a prompt
    has an empty one: different work either way)."""
    return {
        side: [
            make(prompt, out)
            for r, outs in sorted(by_round.items())
            for prompt, out in zip_longest(batches[r + 1], outs, fillvalue=())
        ]
        for side, by_round in outputs.items()
    }


# --- the limit -------------------------------------------------------------------------------


def limit(b: Bench) -> None:
    """Memory bandwidth, matmul speed, and the compute peak of each format's prompt products
    (limits.compute_peak). Decode and throughput measure them again right before their own
    rounds; the best seen in the run is the limit (a busy moment on a shared machine only
    hides what the hardware can do), and its rows are written at the end."""
    n = 1 << 27 if b.device.type == "cuda" else 1 << 25
    weights = decode_bytes_per_token(b.cfg, b.dtype, b.quantize)
    bw = stream_bandwidth(b.device, n) | {
        "read, weights-sized": weights_read_bandwidth(b.device, weights)
    }
    # quantized weights are multiplied as integers: their ceiling is the int8 product's
    gflops = int8_matmul_gops(b.device) if b.quantize else matmul_gflops(b.device, b.dtype)
    old = b.extra.get("limits", {})
    best = {k: max(v, old.get("stream_gb_s", {}).get(k, 0.0)) for k, v in bw.items()}
    kinds = {arithmetic_of(f) for f in (b.main_format, *b.formats.values())}
    old_peaks = old.get("compute_gops", {})
    peaks = {
        k: max(compute_peak(b.device, k), old_peaks.get(k, 0.0)) for k in ARITHMETIC if k in kinds
    }
    b.extra["limits"] = {
        "stream_gb_s": best,
        # the read of the step's own working set: the 128 MiB STREAM arrays sit in a large L3
        # (51 GB/s on an Intel Xeon with 480 MiB of it, where 2 GB of weights read at 33)
        "bandwidth_gb_s": best["read, weights-sized"],
        "matmul_gflops": max(gflops, old.get("matmul_gflops", 0.0)),
        "compute_gops": peaks,  # what a prompt's products can reach (limit_rows)
        "bytes_per_token": weights,
        "flops_per_token": decode_flops_per_token(b.cfg),
        "measurements": old.get("measurements", 0) + 1,
    }


def limit_rows(b: Bench) -> None:
    """The limits and every side's share of the roofline, from the best limits of the run."""
    limits = b.extra.get("limits")
    if limits is None:
        return
    for name, value in limits["stream_gb_s"].items():
        b.rows.append(figure("limit", f"memory bandwidth, {name}", "GB/s", value))
    dtype = str(b.dtype).removeprefix("torch.")
    peak, unit = ("int8 products", "GOP/s") if b.quantize else (dtype, "GFLOP/s")
    b.rows.append(figure("limit", f"matmul peak, {peak}", unit, limits["matmul_gflops"]))
    for kind, ops in limits.get("compute_gops", {}).items():
        unit = "GOP/s" if kind == "int8" else "GFLOP/s"
        b.rows.append(figure("limit", f"compute peak, {kind}", unit, ops))
    for batch in (1, *b.work.concurrency):
        roof = roofline_tokens_per_s(limits, batch)
        b.rows.append(figure("limit", f"decode roofline, batch {batch}", "tok/s", roof))
    for row in b.rows:
        if "bytes_per_token" in row:
            row["roofline"] = roofline_columns(row, lambda n: _read_bandwidth(b, n))
        if peak := limits.get("compute_gops", {}).get(row.get("arithmetic")):
            row["roofline"] = compute_roofline_columns(row, peak)
    labels = {"engine": "Engine", "loop": "decode_step loop", "transformers": "transformers"}
    for section, batch, rates, target in b.shares:
        roof = roofline_tokens_per_s(limits, batch)
        for name, values in rates.items():
            if name not in labels:  # a peer's weights are another size: no share of ours
                continue
            label = f"{labels[name]}, batch {batch}, share of roofline"
            mine = target if name == "engine" else None
            b.rows.append(figure(section, label, "%", 100 * median(values) / roof, None, mine))


def roofline_columns(row: dict, bandwidth: Callable[[float], float]) -> list[float | None]:
    """[ours, reference]: the share of the memory bandwidth each side of a batch-1 decode row
    streams (its tokens/s x its bytes per token over bandwidth(its bytes), GB/s); None for a
    side with no figure or no byte count."""
    rates = [row.get("ours"), row.get("reference")]
    return [
        None if rate is None or n is None else roofline_fraction(rate, n, bandwidth(n))
        for rate, n in zip(rates, row["bytes_per_token"])
    ]


def compute_roofline_columns(row: dict, peak_gops: float) -> list[float | None]:
    """[ours, reference]: the share of the compute peak (limits.compute_peak) a prompt row's
    sides reach, its tokens/s x the flops of a prompt token (prompt_flops_per_token) over it."""
    rates = [row.get("ours"), row.get("reference")]
    return [None if r is None else r * row["flops_per_token"] / (peak_gops * 1e9) for r in rates]


def _read_bandwidth(b: Bench, nbytes: float) -> float:
    """GB/s of reading a working set of nbytes, measured once per size in the run: a side
    whose weights fit in the cache is limited by the cache's speed, one whose do not by the
    memory's."""
    reads = b.extra["limits"].setdefault("read_gb_s_at_bytes", {})
    key = str(int(nbytes))
    if key not in reads:
        reads[key] = weights_read_bandwidth(b.device, int(nbytes))
    return reads[key]


def side_bytes(b: Bench, side: str) -> float | None:
    """Bytes a batch-1 decode step of `side` reads: its weights in its own format and the K/V
    of the workload's mean context (ours and transformers' K/V in the weights' dtype,
    llama.cpp's in float16, its default)."""
    w = b.work
    if side.startswith("llama.cpp"):
        weights, kv_size = gguf_bytes_per_token(b.peer.files[side]), 2
    else:
        name, _, fmt = side.partition(" ")
        if name == "transformers":
            dtype, quantize = b.dtype, None
        elif fmt:
            dtype, quantize = b.format_spec(b.formats[fmt])
        else:
            dtype, quantize = b.dtype, b.quantize
        weights, kv_size = decode_bytes_per_token(b.cfg, dtype, quantize), dtype.itemsize
    return weights + mean_kv_bytes(b.cfg, w.prompt_len, w.new_tokens, kv_size)


# --- inference ---------------------------------------------------------------------------------


def _decode_target(b: Bench) -> float:
    """Batch-1 Engine against transformers: 1.5x in the run's dtype; with 8-bit weights what
    llama.cpp's Q8_0 reaches against transformers float32 on these shapes."""
    if b.quantize is None:
        return 1.5
    return 2.5 if b.size == "smol" else 5.0


def decode(b: Bench) -> None:
    """Batch 1, greedy, exactly new_tokens after a prompt_len prompt (prefill included)."""
    n = b.work.new_tokens
    outputs, rates, bandwidths = {}, {}, {}
    batches = [[prompt] for prompt in b.prompts(b.work.rounds + 1, seed=1)]
    for calls in by_format(b, (*with_formats(b, "engine"), "loop", "transformers"), n):
        read = weights_reader(b.device, int(min(max(side_bytes(b, s) for s in calls), READ_CAP)), 3)
        measured = b.measure(calls, batches, n, outputs, beside={MEMORY: read})
        bandwidths |= dict.fromkeys(calls, measured.pop(MEMORY))
        rates |= measured
    b.extra["decode_reads_gb_s"] = bandwidths  # each side's rounds' reads of the memory
    pairs = [
        ("engine", "transformers", "Engine, batch 1"),
        ("loop", "transformers", "prefill + decode_step loop, batch 1"),
    ]
    choices = _choices(batches, outputs)
    targets = {"engine": _decode_target(b)}
    start = len(b.rows)
    peers = PEER_TARGETS["decode"]
    _reference_rows(b, "decode", rates, pairs, "tok/s", targets, choices, peer_targets=peers)
    for row in b.rows[start:]:  # the roofline column, filled in at the end (limit_rows)
        row["bytes_per_token"] = [side and side_bytes(b, side) for side in row["sides"]]
        row["roofline_in_round"] = [
            side and round_roofline(rates[side], nbytes, bandwidths[side])
            for side, nbytes in zip(row["sides"], row["bytes_per_token"])
        ]
    b.shares.append(("decode", 1, rates, 50.0 if b.size == "smol" else None))
    # every pair, the Engine and the loop too: they run the same code and should agree fully
    b.extra["greedy_agreement"] = {
        f"{x}_vs_{y}": agreement(choices[x], choices[y]) for x, y in combinations(choices, 2)
    }


def throughput(b: Bench) -> None:
    """c concurrent requests in one go: total generated tokens / wall time."""
    n, concurrency = b.work.new_tokens, b.work.concurrency
    batches = {
        c: [b.prompts(c, seed=100 * c + r) for r in range(b.work.rounds + 1)] for c in concurrency
    }
    outputs: dict = {c: {} for c in concurrency}
    rates: dict = {c: {} for c in concurrency}
    for calls in by_format(b, (*with_formats(b, "engine"), "transformers"), n):
        for c in concurrency:
            rates[c] |= b.measure(calls, batches[c], c * n, outputs[c])
    for c in concurrency:
        targets = {"engine": THROUGHPUT_TARGETS.get(c)}
        pairs = [("engine", "transformers", f"Engine, {c} concurrent requests")]
        choices = _choices(batches[c], outputs[c])
        peers = PEER_TARGETS.get(f"throughput {c}")
        _reference_rows(b, "throughput", rates[c], pairs, "tok/s", targets, choices, 0, peers)
        b.shares.append(("throughput", c, rates[c], None))


def _next_tokens(logits) -> list[list[int]]:
    """A prefill's greedy choices per row: the argmax of our and transformers' logits
    ([B, V], [B, T, V] or [B, 1, V]), llama.cpp's answer as it gives them."""
    if isinstance(logits, dict):
        return [[token] for token in logits["next"]]
    return logits.argmax(-1).reshape(len(logits), -1).tolist()


def prefill(b: Bench) -> None:
    """batch x length prompt tokens in one forward: all logits (as training computes them),
    and the paged prefill that writes K/V and keeps the last logits (as serving does)."""
    batch, length = b.work.prefill
    g = torch.Generator().manual_seed(3)
    inputs = [
        torch.randint(0, b.cfg.vocab_size, (batch, length), generator=g).to(b.device)
        for _ in range(b.work.rounds + 1)
    ]
    makers = {
        "forward": lambda: lambda x: ours.forward_logits(b.params, b.cfg, x),
        "prefill": lambda: ours.paged_prefill_fn(
            ours.prepared(b.params, b.cfg, b.quantize), b.cfg, batch, length
        ),
        **{
            f"prefill {fmt}": lambda fmt=fmt: ours.paged_prefill_fn(
                b._weights(f"format {fmt}"), b.cfg, batch, length
            )
            for fmt in b.formats
        },
        "ref_forward": lambda: lambda x: reference.forward(b.reference, x, last_only=False),
        "ref_prefill": lambda: lambda x: reference.forward(b.reference, x, last_only=True),
    }
    outputs, rates = {}, {}
    for names, files in format_groups(b, tuple(_available(b, makers))):
        # each format's weights are made for its group and dropped after it (see format_groups)
        calls = {name: makers[name]() for name in names} | prefill_calls(b.peer, files)
        rates |= b.measure(calls, inputs, batch * length, outputs, keep=_next_tokens)
        release(b.peer, files)
    pairs = [
        ("forward", "ref_forward", f"forward, {batch} x {length}, all logits"),
        ("prefill", "ref_prefill", f"paged prefill, {batch} x {length}, last logits"),
    ]
    choices = _choices([x.tolist() for x in inputs], outputs, predicted)
    start = len(b.rows)
    peers = PEER_TARGETS["prefill"]
    _reference_rows(b, "prefill", rates, pairs, "tok/s", {"prefill": 1.0}, choices, 1, peers)
    for row in b.rows[start:]:  # the compute roofline column, filled in at the end (limit_rows)
        mine = row["sides"][0]
        if mine and mine.startswith("prefill"):
            fmt = b.formats.get(mine.partition(" ")[2]) or b.main_format
            row["arithmetic"] = arithmetic_of(fmt)
            row["flops_per_token"] = prompt_flops_per_token(b.cfg, length)


# --- training ----------------------------------------------------------------------------------


def train(b: Bench) -> None:
    """batch x length tokens per optimizer step (AdamW, clip 1.0) from the same weights, in
    float32 and in bf16 mixed precision (bf16 compute under autocast, float32 weights and
    optimizer state) on both sides; each stepper trains its own copy in a process of its own
    (benchmark/train_worker.py), and a row's two sides alternate rounds with no other worker
    alive: on a VM, a third process holding gigabytes made transformers' steps, which fault
    in fresh pages, up to 2x slower and erratic (docs/benchmarks.md)."""
    batch, length = b.work.train
    precisions = {"": "float32", "_bf16": "bfloat16"}
    if why := bf16_skip_reason(b.device):  # emulated bf16 training ran for more than 20 minutes
        b.skip("train", "train_step bf16 (ours and transformers)", why)
        del precisions["_bf16"]
    modes = ("eager", "compiled") if b.work.compile_train else ("eager",)
    if not b.work.compile_train:
        b.note("train: compiled train_step skipped (compiling takes minutes; runs without --quick)")
    rates: dict[str, list[float]] = {}
    for mode, (suffix, precision) in product(modes, precisions.items()):
        spec = {
            "compile": mode == "compiled",
            "precision": precision,
            "folder": str(b.folder),
            "device": str(b.device),
            "workload": dataclasses.asdict(b.work),
            "hyper": TRAIN_HYPER,
        }
        pair = {mode + suffix: {**spec, "side": "ours"}}
        if b.reference is not None:
            name = "transformers" + ("_compiled" if mode == "compiled" else "") + suffix
            pair[name] = {**spec, "side": "transformers"}
        rates |= _train_rates(b, pair)
    pairs = [
        ("eager", "transformers", f"train_step eager, {batch} x {length}"),
        ("compiled", "transformers_compiled", f"train_step compiled, {batch} x {length}"),
        ("eager_bf16", "transformers_bf16", f"train_step eager bf16, {batch} x {length}"),
        (
            "compiled_bf16",
            "transformers_compiled_bf16",
            f"train_step compiled bf16, {batch} x {length}",
        ),
    ]
    pairs = [p for p in pairs if p[0] in rates and p[1] in rates]
    targets = {"eager": 1.2, "compiled": 1.2, "eager_bf16": 1.2, "compiled_bf16": 1.2}
    _reference_rows(b, "train", rates, pairs, "tok/s", targets)
    _train_precision_rows(b, rates, length)


def _train_rates(b: Bench, specs: dict[str, dict]) -> dict[str, list[float]]:
    """{name: [tokens/s per round]} of the steppers, each in a worker, in alternating rounds
    timed by the workers; the first step (for torch.compile, the compiling) is taken as each
    worker starts."""
    from .isolated import side_processes

    batch, length = b.work.train
    steps = b.work.train_steps
    with side_processes(specs, torch.get_num_threads(), "train_worker.py") as workers:
        for name, worker in workers.items():
            facts = worker.facts
            b.extra[f"train_first_step_s_{name}"] = facts["first_step_s"]
            b.extra[f"train_first_loss_{name}"] = facts["first_loss"]
            b.log(
                f"train: first {name} step took {facts['first_step_s']:.1f} s, "
                f"loss {facts['first_loss']:.4f}"
            )
            if breaks := facts["graph_breaks"]:
                reasons = "; ".join(sorted(breaks)[:3])
                b.note(f"train: {name} has {sum(breaks.values())} graph break(s): {reasons}")
        tokens = steps * batch * length

        def rate(worker) -> Callable[[int], float]:  # batch 0 was the first step's
            return lambda r: tokens / worker.ask({"batch": r + 1})["seconds"]

        return interleave({name: rate(w) for name, w in workers.items()}, b.work.rounds)


def _train_precision_rows(b: Bench, rates: dict[str, list[float]], length: int) -> None:
    """bf16 against float32 on our side, and each side's model flops utilisation: training
    flops per token (astrai.train.mfu: 6 per matrix weight plus the attention products) times
    tokens/s over the machine's matmul peak for the row's dtype (the best rate recorded on
    it, astrai.train.matmul_peak), the same figure `just train` prints. bf16 is measured only where its rows ran (where it is native)."""
    from astrai.train.mfu import matmul_peak_gflops, mfu, train_flops_per_token

    dtypes = {torch.bfloat16 if name.endswith("_bf16") else torch.float32 for name in rates}
    peaks = {dtype: matmul_peak_gflops(b.device, dtype) for dtype in dtypes}
    for dtype, peak in peaks.items():
        name = "bf16" if dtype == torch.bfloat16 else "float32"
        b.extra[f"{name}_matmul_gflops"] = peak
        b.rows.append(figure("limit", f"matmul peak, {name}", "GFLOP/s", peak))
    for mode in ("eager", "compiled"):
        if f"{mode}_bf16" in rates:
            b.rows.append(
                compare(
                    "train",
                    f"train_step {mode}, bf16 over float32",
                    "tok/s",
                    rates[f"{mode}_bf16"],
                    rates[mode],
                    f"ours {mode} float32",
                )
            )
    flops_per_token = train_flops_per_token(b.cfg, length)
    for name, values in rates.items():
        bf16 = name.endswith("_bf16")
        dtype = torch.bfloat16 if bf16 else torch.float32
        share = 100 * mfu(median(values), flops_per_token, peaks[dtype])
        side = name.removesuffix("_bf16").replace("_", " ")
        side = side if side.startswith("transformers") else f"ours {side}"
        label = f"{side} {'bf16' if bf16 else 'float32'}, MFU of the {'bf16' if bf16 else 'float32'} matmul peak"
        b.rows.append(figure("train", label, "%", share, None))


def structured(b: Bench) -> None:
    """Greedy decoding with every request held to a JSON grammar against free decoding on the
    same Engine (the same weights, --quantize and tokenizer), at batch 1 and 16: what the
    masks cost (target: at most 10% at batch 16). A grammar needs a byte-level tokenizer (the
    run's word-level one has no bytes): both sides use one trained on JSON records, filled up
    to the model's vocabulary so that every token free decoding picks decodes to text."""
    n = b.work.new_tokens
    tokenizer = ours.json_tokenizer(b.cfg.vocab_size)
    engine = ours.make_engine(b.params, b.cfg, tokenizer, b.work, b.device, b.dtype, b.quantize)
    constraint = ours.endless_records()
    calls = {
        "constrained": lambda p: ours.engine_generate(engine, p, n, constraint=constraint),
        "free": lambda p: ours.engine_generate(engine, p, n),
    }
    try:
        for c in (1, 16):
            batches = [b.prompts(c, seed=500 * c + r) for r in range(b.work.rounds + 1)]
            outputs: dict = {}
            rates = b.measure(calls, batches, c * n, outputs)
            target = 0.9 if c == 16 and b.size != "tiny" else None
            label = f"JSON-constrained decoding, batch {c}"
            pair, choices = ("constrained", "free"), _choices(batches, outputs)
            # the grammar makes the tokens differ: only the work is compared
            row = _compared(b, "structured", label, "tok/s", rates, pair, choices,
                            "free decoding", target, greedy=False)  # fmt: skip
            b.rows.append(row)
    finally:
        engine.close()


# --- serving -----------------------------------------------------------------------------------


def _streamed(tokenizer):
    """keep for measure: a stream load's completions as token ids (the benchmark's tokenizer
    gives every token its own word, so its text encodes back to the very ids), other sides'
    completions as they are."""
    return lambda out: [tokenizer.encode(t) for t in out["texts"]] if isinstance(out, dict) else out


def serve(b: Bench) -> None:
    """N clients streaming at once over HTTP, against the same Engine called directly."""
    from .serving import LATENCIES, latency_summary, serving, stream_load

    n, clients, rounds = b.work.new_tokens, b.work.clients, b.work.rounds
    engine = engine_of(b)
    batches = [b.prompts(clients, seed=7000 + r) for r in range(rounds + 1)]
    loads: list[dict] = []
    outputs: dict = {}
    with serving(engine) as url:

        def over_http(batch):
            loads.append(stream_load(url, batch, n))
            return loads[-1]

        stream_load(url, batches[0][:2], 4)  # warm-up: connections, first requests
        calls = {"http": over_http, "direct": lambda batch: ours.engine_generate(engine, batch, n)}
        keep = _streamed(b.tokenizer)
        rates = b.measure(calls, batches, clients * n, outputs, warm_up=False, keep=keep)
    label = f"{clients} streaming clients over HTTP"
    pair, choices = ("http", "direct"), _choices(batches, outputs)
    b.rows.append(_compared(b, "serve", label, "tok/s", rates, pair, choices, "Engine"))
    per_second = [clients / load["wall_s"] for load in loads]
    label = f"{clients} clients, requests"
    b.rows.append(figure("serve", label, "req/s", median(per_second), per_second))
    for (kind, q), value in latency_summary(loads).items():
        b.rows.append(figure("serve", f"{LATENCIES[kind]} p{q}", "ms", value))


def isolated(b: Bench) -> None:
    """One streaming client of a real `just serve` process against the bare prefill +
    decode_step loop in a clean process: batch 1, the same weights file, dtype and quantize,
    alternating rounds timed from this process."""
    from .isolated import serve_process
    from .serving import stream_load

    n = b.work.new_tokens
    dtype = str(b.dtype).removeprefix("torch.")
    threads = torch.get_num_threads()
    # a stream of one request is short, and a small machine's speed drifts by more than the
    # target's 5 % between rounds: three times the workload's rounds
    batches = [[prompt] for prompt in b.prompts(3 * b.work.rounds + 1, seed=11)]
    if not (b.folder / "tokenizer.json").exists():  # just serve reads it from the folder
        b.tokenizer.save_pretrained(b.folder)
    outputs: dict = {}
    with (
        sides(b, ("loop",)) as generate,
        serve_process(b.folder, dtype, b.quantize, threads) as url,
    ):
        calls = {
            "serve": lambda batch: stream_load(url, batch, n),
            "loop": lambda batch: generate["loop"](batch, n),
        }
        rates = b.measure(calls, batches, n, outputs, keep=_streamed(b.tokenizer))
    label = "just serve process, 1 streaming client vs the loop in a clean process"
    pair, choices = ("serve", "loop"), _choices(batches, outputs)
    b.rows.append(_compared(b, "isolated", label, "tok/s", rates, pair, choices, "loop", 0.95))


def speculation(b: Bench) -> None:
    """The Engine with speculative decoding against the Engine without (speculating.py)."""
    from .speculating import speculation as measure_speculation

    measure_speculation(b)


def window(b: Bench) -> None:
    """KV pages of a window-only model at 8k tokens against its window (window.py)."""
    from .window import window_memory

    window_memory(b)


def adapters(b: Bench) -> None:
    """16 streams over 8 LoRA adapters in one batch against base-only streams and against
    each adapter merged and served alone, one after another; the adapters' memory
    (adapters.py)."""
    from .adapters import adapters as measure

    measure(b)


SECTIONS: dict[str, Callable[[Bench], None]] = {
    "limit": limit,
    "decode": decode,
    "throughput": throughput,
    "prefill": prefill,
    "train": train,
    "structured": structured,
    "serve": serve,
    "isolated": isolated,
    "speculation": speculation,
    "window": window,
    "adapters": adapters,
}
