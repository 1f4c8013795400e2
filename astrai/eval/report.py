"""Running a task list and writing down what came out: a JSON file and a printed table, each
with the model, the data's checksum, the settings and the time taken."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TextIO

import msgspec

from astrai.config import EvalConfig
from astrai.eval.tasks import Model, checksum, run_task

# the metrics the table shows (all of them go to the JSON file)
HEADLINE = ("loss", "perplexity", "bits_per_byte", "accuracy", "accuracy_per_token",
            "accuracy_per_byte")  # fmt: skip


def evaluate_tasks(model: Model, cfg: EvalConfig, log: TextIO | None = None) -> list[dict]:
    """Every task of `cfg` on the model -> one result per task: name, kind, data, checksum,
    settings, metrics and seconds."""
    results = []
    for task in cfg.tasks:
        started = time.monotonic()
        metrics = run_task(model, task, cfg.batch_size, log)
        results.append(
            {
                "name": task.name,
                "kind": task.kind,
                "data": task.data,
                "checksum": checksum(task.data),
                "settings": msgspec.to_builtins(task),
                "metrics": metrics,
                "seconds": round(time.monotonic() - started, 3),
            }
        )
    return results


def flat_metrics(results: list[dict], prefix: str = "eval/") -> dict[str, float]:
    """{"eval/TASK/METRIC": value} of the headline metrics, as metrics.jsonl records them."""
    return {
        f"{prefix}{r['name']}/{k}": v
        for r in results
        for k, v in r["metrics"].items()
        if k in HEADLINE or k.startswith("pass@")
    }


def write_results(path: Path, model_dir: str, results: list[dict], seconds: float) -> None:
    report = {
        "model": str(model_dir),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(seconds, 3),
        "tasks": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def format_table(model_dir: str, results: list[dict]) -> str:
    """One line per task metric, under a header naming the model."""
    lines = [f"model {model_dir}", f"{'task':<20} {'metric':<20} {'value':>12}  data"]
    for r in results:
        shown = [(k, v) for k, v in r["metrics"].items() if k in HEADLINE or k.startswith("pass@")]
        for j, (k, v) in enumerate(shown):
            data = f"{Path(r['data']).name} {r['checksum'][:19]}" if j == 0 else ""
            name = r["name"] if j == 0 else ""
            lines.append(f"{name:<20} {k:<20} {v:>12.4f}  {data}")
        count = r["metrics"].get("records", r["metrics"].get("tokens"))
        unit = "records" if "records" in r["metrics"] else "tokens"
        lines.append(f"{'':<20} {'(' + str(count) + ' ' + unit + ', ' + str(r['seconds']) + ' s)'}")
    return "\n".join(lines)
