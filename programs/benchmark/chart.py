"""The run's chart: per panel, one horizontal bar per figure against a reference line (parity
with the reference, or the hardware limit) and, where there is one, the target."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from figures import pyplot

BAR, TARGET, REFERENCE = "#4c72b0", "#dd8452", "#222222"


@dataclass(frozen=True)
class Panel:
    """One group of bars: (label, value, target or None), with a line at `ref`."""

    title: str
    bars: list[tuple[str, float, float | None]]
    ref: float
    ref_label: str  # what the line at `ref` means, for the legend
    axis: str  # the value axis, with its unit
    fmt: str  # how a value is written next to its bar, e.g. "{:.2f}x"


def write_chart(path: Path, title: str, panels: list[Panel]) -> None:
    """Draw the panels (those with bars) to a PNG; raises NoMatplotlib without matplotlib."""
    plt = pyplot()
    panels = [p for p in panels if p.bars]
    heights = [0.45 * len(p.bars) + 1.6 for p in panels] or [1.5]
    fig, axes = plt.subplots(
        len(heights), 1, figsize=(10, sum(heights) + 0.8), squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )  # fmt: skip
    fig.suptitle(title, fontsize=12)
    for ax, panel in zip(axes[:, 0], panels):
        _draw(ax, panel)
    if not panels:
        axes[0, 0].axis("off")
        axes[0, 0].text(0.5, 0.5, "no figures in this run", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw(ax, panel: Panel) -> None:
    labels = [label for label, _, _ in panel.bars]
    values = [value for _, value, _ in panel.bars]
    rows = range(len(labels))
    ax.barh(rows, values, color=BAR, height=0.6, label="measured (median)")
    ax.set_yticks(rows, labels, fontsize=9)
    ax.invert_yaxis()  # the first figure on top, as in the table
    ax.axvline(panel.ref, color=REFERENCE, linewidth=1.2, label=panel.ref_label)
    targets = [(y, t) for y, (_, _, t) in enumerate(panel.bars) if t is not None]
    if targets:
        ys, ts = zip(*targets)
        ax.scatter(ts, ys, marker="|", s=400, linewidths=3, color=TARGET, label="target", zorder=3)
    for y, value in enumerate(values):
        ax.annotate(
            panel.fmt.format(value), (max(value, 0.0), y), xytext=(4, 0),
            textcoords="offset points", va="center", fontsize=8,
        )  # fmt: skip
    top = max([*values, panel.ref, *(t for _, t in targets)])
    ax.set_xlim(0, top * 1.15)
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.set_xlabel(panel.axis)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
