"""Results as rows of plain data: printed as a table, written as JSON and Markdown."""

from __future__ import annotations

from .timing import median


def compare(
    section: str,
    name: str,
    unit: str,
    ours: list[float],
    reference: list[float],
    reference_name: str = "transformers",
    target: float | None = None,
) -> dict:
    """Ours against a reference measured in the same rounds. The ratio is of the medians;
    the range is the lowest and highest ratio of a single round (how noisy the run was)."""
    per_round = [a / b for a, b in zip(ours, reference) if b > 0]
    ratio = median(ours) / median(reference) if median(reference) > 0 else float("nan")
    return {
        "section": section,
        "name": name,
        "unit": unit,
        "ours": median(ours),
        "ours_rounds": ours,
        "reference": median(reference),
        "reference_rounds": reference,
        "reference_name": reference_name,
        "ratio": ratio,
        "ratio_range": [min(per_round), max(per_round)] if per_round else None,
        "target": target,
        "met": None if target is None else ratio >= target,
    }


def figure(
    section: str,
    name: str,
    unit: str,
    value: float,
    rounds: list[float] | None = None,
    target: float | None = None,
    higher_is_better: bool = True,
) -> dict:
    """One of our figures with nothing to compare it with (a limit, a latency)."""
    met = None
    if target is not None:
        met = value >= target if higher_is_better else value <= target
    return {
        "section": section,
        "name": name,
        "unit": unit,
        "ours": value,
        "ours_rounds": rounds or [value],
        "target": target,
        "met": met,
    }


def _number(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return f"{text} {unit}".rstrip()


MARKS = {"not comparable": " NOT COMPARABLE", "unchecked": " unchecked"}


def _ratio_text(row: dict) -> str:
    if row.get("verdict") == "refused":
        return "REFUSED"
    if row.get("skipped"):
        return "skipped (ours)"
    ratio = row.get("ratio")
    if ratio is None:
        return "-"
    text = f"{ratio:.2f}x"
    if row.get("ratio_range"):
        low, high = row["ratio_range"]
        text += f" ({low:.2f}-{high:.2f})"
    return text + MARKS.get(row.get("verdict"), "")


def _cells(row: dict) -> list[str]:
    target = row["target"]
    suffix = "x" if "ratio" in row else f" {row['unit']}"
    target_text = "-" if target is None else f"{target:g}{suffix}"
    if row["met"] is not None:
        target_text += " ok" if row["met"] else " MISSED"
    reference = _number(row.get("reference"), row["unit"])
    if "reference_name" in row and row["reference_name"] != "transformers":
        reference += f" ({row['reference_name']})"
    agreement = "-" if row.get("agreement") is None else f"{row['agreement']:.0%}"
    return [row["section"], row["name"], _number(row["ours"], row["unit"]), reference,
            _ratio_text(row), roofline_text(row.get("roofline"), row.get("roofline_in_round")),
            agreement, target_text]  # fmt: skip


def roofline_text(
    fractions: list[float | None] | None, in_round: list[float | None] | None = None
) -> str:
    """A batch-1 decode row's shares of the memory bandwidth, "ours / reference" in %: of the
    run's best read, then (in brackets) of the read in each round, their median."""
    if not fractions:
        return "-"
    text = " / ".join("-" if f is None else f"{f:.0%}" for f in fractions)
    return f"{text} ({roofline_text(in_round)})" if in_round else text


HEADER = ["section", "measurement", "ours", "reference", "ratio (range)", "roofline, ours / ref (in round)", "greedy agreement", "target"]  # fmt: skip


def verdicts(rows: list[dict]) -> list[str]:
    """A line for each comparison that is not of like things, saying why."""
    return [
        f"{row['verdict'].upper()}: {row['section']}: {row['name']}: {row['why']}"
        for row in rows
        if row.get("verdict") in ("refused", "not comparable", "unchecked")
    ]


def table(rows: list[dict]) -> str:
    """A fixed-width text table for the terminal."""
    cells = [HEADER, *(_cells(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """The same table in Markdown, ready for docs/benchmarks.md."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)
