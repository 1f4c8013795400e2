"""The serving benchmark's pictures: per workload, throughput and latency percentiles against
the arrival rate, one line per server variant."""

from __future__ import annotations

from pathlib import Path

PANELS = [
    ("output tokens / s", ["output_tok_s"]),
    ("time to first token (ms)", ["ttft_p50_ms", "ttft_p99_ms"]),
    ("time per output token (ms)", ["tpot_p50_ms", "tpot_p99_ms"]),
    ("gap between hand-overs (ms)", ["handover_p50_ms", "handover_p99_ms"]),
    ("end-to-end latency (ms)", ["e2e_p50_ms", "e2e_p99_ms"]),
]


def rate_label(rate: float) -> str:
    return "all at once" if rate == float("inf") else f"{rate:.3g}/s"


def draw(results: dict, out_dir: Path) -> list[Path]:
    """One PNG per workload in out_dir; raises NoMatplotlib without matplotlib."""
    from figures import pyplot

    plt = pyplot()
    paths = []
    for workload in sorted({run["workload"] for run in results["runs"]}):
        runs = [r for r in results["runs"] if r["workload"] == workload]
        rates = sorted({r["rate"] for r in runs})
        fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
        for ax, (title, keys) in zip(axes, PANELS):
            for variant in dict.fromkeys(r["variant"] for r in runs):
                mine = sorted((r for r in runs if r["variant"] == variant), key=lambda r: r["rate"])
                xs = [rates.index(r["rate"]) for r in mine]
                for key, style in zip(keys, ("-o", "--x")):
                    label = variant if len(keys) == 1 else f"{variant} {key.split('_')[1]}"
                    ax.plot(xs, [r["figures"][key] for r in mine], style, label=label)
            ax.set_title(title, fontsize=10)
            ax.set_xticks(range(len(rates)), [rate_label(r) for r in rates], fontsize=8)
            ax.set_xlabel("arrival rate (Poisson)", fontsize=8)
            if "(ms)" in title:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[-1].legend(fontsize=7, loc="best")
        fig.suptitle(f"{workload} workload ({results['config']['size']} model)")
        fig.tight_layout()
        path = out_dir / f"{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
