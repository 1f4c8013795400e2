"""Run metrics: one JSON object per line in RUN_DIR/metrics.jsonl, and a one-line progress bar."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TextIO


def append_metrics(path: str | Path, record: dict) -> None:
    """Append one record; the file is reopened each time so a killed run loses nothing written."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    """Every complete record (a line torn by a crash is ignored)."""
    records = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def truncate_metrics(path: str | Path, step: int) -> None:
    """Drop records after `step`: a resumed run writes those steps again."""
    if Path(path).exists():
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in kept))


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


class Throughput:
    """Tokens per second and time left, measured since the run (or resume) started."""

    def __init__(self, start_step: int) -> None:
        self.start_step, self.start_time = start_step, time.perf_counter()
        self.window_start, self.window_tokens = self.start_time, 0.0

    def update(self, tokens: float) -> None:
        self.window_tokens += tokens

    def tokens_per_s(self) -> float:
        """The rate since the previous call: recent speed, not diluted by start-up time."""
        now = time.perf_counter()
        rate = self.window_tokens / max(now - self.window_start, 1e-9)
        self.window_start, self.window_tokens = now, 0.0
        return rate

    def reset_window(self) -> None:
        self.window_start, self.window_tokens = time.perf_counter(), 0.0

    def eta(self, step: int, max_steps: int) -> float:
        done = step - self.start_step
        if done <= 0:
            return math.inf
        return (time.perf_counter() - self.start_time) / done * (max_steps - step)


def progress_line(step: int, max_steps: int, metrics: dict, tok_s: float, eta: float) -> str:
    width = 20
    filled = int(width * step / max(max_steps, 1))
    bar = "#" * filled + "." * (width - filled)
    parts = [
        f"[{bar}] {step}/{max_steps}",
        f"loss {metrics['loss']:.4f}",
        f"lr {metrics['lr']:.2e}",
        f"{tok_s:,.0f} tok/s",
    ]
    if "mfu" in metrics:  # model flops per second over the dtype's measured matmul peak
        parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
    parts.append(f"eta {_duration(eta)}")
    if metrics.get("skipped"):
        parts.append(f"skipped {metrics['skipped']}")
    return "  ".join(parts)


def show_progress(line: str, out: TextIO = sys.stderr, final: bool = False) -> None:
    """Redraw in place on a terminal; one line per update in a log file."""
    if out.isatty():
        out.write("\r" + line + ("\n" if final else ""))
    else:
        out.write(line + "\n")
    out.flush()
