"""Draw a training run's curves (loss and eval loss, LR, gradient norm, tokens/s, GRPO's
reward per round, and the [eval] tasks' accuracy and bits per byte) to a PNG, with the numbers drawn beside it as JSON.

    python programs/plot.py RUN_DIR [--out PATH]        # default: RUN_DIR/curves.png

Drawing needs matplotlib (`pip install -e ".[plot]"`); without it the curves are still written
to curves.json and the program says how to install it.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # figures.py beside it

from figures import NoMatplotlib, pyplot

from astrai.train.metrics import read_metrics

# (title, y axis with its unit, metric names); a name with "*" matches logged keys as a glob
PANELS = [
    ("Loss", "cross-entropy (nats per token)", ("loss", "eval_loss")),
    ("Learning rate", "learning rate", ("lr",)),
    ("Gradient norm", "global L2 norm, before clipping", ("grad_norm",)),
    ("Throughput", "tokens per second", ("tokens_per_s",)),
    ("GRPO reward", "mean reward per round", ("reward_mean", "reward_mean/*")),
    ("Task accuracy", "fraction right ([eval] tasks)", ("eval/*/accuracy*", "eval/*/pass@*")),
    ("Held-out text", "bits per byte ([eval] perplexity tasks)", ("eval/*/bits_per_byte",)),
]
LABELS = {"loss": "train loss", "eval_loss": "held-out loss", "reward_mean": "total (weighted)"}
Series = tuple[str, list[float], list[float]]
Panel = tuple[str, str, list[Series]]


def curves(records: list[dict]) -> list[Panel]:
    """Per panel: its title, its y axis and (name, steps, values) for every metric logged."""
    panels = []
    logged = list(dict.fromkeys(k for r in records for k in r))
    for title, axis, patterns in PANELS:
        series = []
        names = [n for p in patterns for n in (logged if "*" in p else [p]) if fits(n, p)]
        for name in names:
            points = [
                (r["step"], float(r[name]))
                for r in records
                if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])
            ]
            if points:
                series.append((name, [p[0] for p in points], [p[1] for p in points]))
        if series:
            panels.append((title, axis, series))
    return panels


def fits(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) if "*" in pattern else name == pattern


def draw(path: Path, title: str, panels: list[Panel]) -> None:
    """The panels in a grid of two columns, to a PNG; raises NoMatplotlib without it."""
    plt = pyplot()
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 3.6 * rows + 0.6), squeeze=False)
    fig.suptitle(title, fontsize=13)
    for ax, (name, axis, series) in zip(axes.flat, panels):
        for metric, xs, ys in series:
            sparse = metric == "eval_loss" or len(xs) < 20  # few points: show each one
            label = LABELS.get(metric, metric.removeprefix("reward_mean/").removeprefix("eval/"))
            ax.plot(xs, ys, label=label, marker="o" if sparse else None, ms=3)
        ax.set_title(name, fontsize=11)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(axis)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_run(run_dir: Path, out: Path) -> Path:
    """Write run_dir's curves to `out` (PNG) and beside it as JSON -> the JSON's path. The
    JSON is written first, so it exists even when drawing raises NoMatplotlib."""
    records = read_metrics(run_dir / "metrics.jsonl")
    panels = curves(records)
    if not panels:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no metrics to plot")
    data = out.with_suffix(".json")
    series = {name: {"step": xs, "value": ys} for _, _, s in panels for name, xs, ys in s}
    data.write_text(json.dumps(series) + "\n")
    title = f"{run_dir.resolve().name}: {records[-1].get('step', '?')} steps"
    draw(out, title, panels)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a training run's out_dir")
    parser.add_argument("--out", type=Path, help="PNG to write (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    out = args.out or args.run_dir / "curves.png"
    try:
        plot_run(args.run_dir, out)
    except NoMatplotlib as exc:
        print(f"wrote {out.with_suffix('.json')}; {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
