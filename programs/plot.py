"""Draw a training run's curves (loss and eval loss, LR, gradient norm, tokens/s, and GRPO's
reward per round) to a PNG.

    python programs/plot.py RUN_DIR [--out PATH]        # default: RUN_DIR/curves.png

Uses matplotlib when it is installed; otherwise draws the curves itself (3x5 pixel font,
zlib + struct PNG), so plotting never needs an extra dependency.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

from astrai.bench.chart import BLACK, BLUE, CHAR_W, GREY, ORANGE, ROW_H, Canvas, encode_png
from astrai.train.metrics import read_metrics

PANELS = [
    ("loss", ("loss", "eval_loss")),
    ("learning rate", ("lr",)),
    ("grad norm", ("grad_norm",)),
    ("tokens/s", ("tokens_per_s",)),
    ("reward", ("reward_mean", "reward_mean/*")),  # "*": every logged key with that prefix
]
Series = tuple[str, list[float], list[float]]
COLORS = (BLUE, ORANGE, (85, 168, 104))  # a third for the reward panel's several rewards


def curves(records: list[dict]) -> list[tuple[str, list[Series]]]:
    """Per panel: its title and (name, steps, values) for every metric that was logged."""
    panels = []
    logged = list(dict.fromkeys(k for r in records for k in r))
    for title, patterns in PANELS:
        series = []
        names = [n for p in patterns for n in (logged if p.endswith("*") else [p]) if fits(n, p)]
        for name in names:
            points = [
                (r["step"], float(r[name]))
                for r in records
                if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])
            ]
            if points:
                series.append((name, [p[0] for p in points], [p[1] for p in points]))
        if series:
            panels.append((title, series))
    return panels


def fits(name: str, pattern: str) -> bool:
    return name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern


def plot_matplotlib(plt, path: Path, title: str, panels) -> None:
    rows = max(2, (len(panels) + 1) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.5 * rows), squeeze=False)
    fig.suptitle(title)
    for ax, (name, series) in zip(axes.flat, panels):
        for label, xs, ys in series:
            ax.plot(xs, ys, label=label, marker="o" if label == "eval_loss" else None, ms=3)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _line(canvas: Canvas, x0: int, y0: int, x1: int, y1: int, color) -> None:
    steps = max(abs(x1 - x0), abs(y1 - y0), 1)
    for i in range(steps + 1):
        x = round(x0 + (x1 - x0) * i / steps)
        y = round(y0 + (y1 - y0) * i / steps)
        canvas.rect(x, y, x + 2, y + 2, color)


def _panel(canvas: Canvas, left: int, top: int, w: int, h: int, name: str, series) -> None:
    x0, x1, y0, y1 = left + 10 * CHAR_W, left + w - 16, top + 2 * ROW_H, top + h - 2 * ROW_H
    canvas.text(left + 8, top + 6, name)
    xs = [x for _, sx, _ in series for x in sx]
    ys = [y for _, _, sy in series for y in sy]
    lo_x, hi_x, lo_y, hi_y = min(xs), max(xs), min(ys), max(ys)
    if hi_y == lo_y:
        lo_y, hi_y = lo_y - 0.5 * (abs(lo_y) or 1), hi_y + 0.5 * (abs(hi_y) or 1)
    span_x = (hi_x - lo_x) or 1
    for x in (x0, x1):
        canvas.rect(x, y0, x + 1, y1 + 1, GREY)
    for y in (y0, y1):
        canvas.rect(x0, y, x1 + 1, y + 1, GREY)
    canvas.text(left + 8, y0, f"{hi_y:.3g}")
    canvas.text(left + 8, y1 - 10, f"{lo_y:.3g}")
    canvas.text(x0, y1 + 6, f"{lo_x:g}")
    canvas.text(x1 - CHAR_W * len(f"{hi_x:g}"), y1 + 6, f"{hi_x:g}")
    canvas.text(x0 + (x1 - x0) // 2 - 2 * CHAR_W, y1 + 6, "step")
    for i, (label, sx, sy) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        canvas.text(x1 - CHAR_W * (len(label) + 1), top + 6 + i * ROW_H, label, color)
        points = [
            (
                x0 + round((x - lo_x) / span_x * (x1 - x0)),
                y1 - round((y - lo_y) / (hi_y - lo_y) * (y1 - y0)),
            )
            for x, y in zip(sx, sy)
        ]
        for a, b in itertools.pairwise(points):
            _line(canvas, *a, *b, color)
        if label == "eval_loss" or len(points) == 1:  # sparse points get markers
            for x, y in points:
                canvas.rect(x - 3, y - 3, x + 4, y + 4, color)


def render_curves(title: str, panels, width: int = 1000, panel_h: int = 300) -> bytes:
    """The panels in a 2-column grid, as PNG bytes."""
    rows = max(1, (len(panels) + 1) // 2)
    height = ROW_H * 2 + rows * panel_h
    canvas = Canvas(width, height)
    canvas.text(8, 8, title, BLACK)
    panel_w = width // 2
    for i, (name, series) in enumerate(panels):
        left, top = (i % 2) * panel_w, ROW_H * 2 + (i // 2) * panel_h
        _panel(canvas, left, top, panel_w, panel_h, name, series)
    return encode_png(canvas.pixels, width, height)


def plot_run(run_dir: Path, out: Path) -> str:
    """Draw run_dir's metrics.jsonl to `out`; returns which renderer drew it."""
    records = read_metrics(run_dir / "metrics.jsonl")
    panels = curves(records)
    if not panels:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no metrics to plot")
    title = f"{run_dir.resolve().name}: {records[-1].get('step', '?')} steps"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out.write_bytes(render_curves(title, panels))
        return "builtin"
    plot_matplotlib(plt, out, title, panels)
    return "matplotlib"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a training run's out_dir")
    parser.add_argument("--out", type=Path, help="PNG to write (default RUN_DIR/curves.png)")
    args = parser.parse_args()
    out = args.out or args.run_dir / "curves.png"
    try:
        renderer = plot_run(args.run_dir, out)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({renderer})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
