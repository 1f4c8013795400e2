"""From nothing to a trained, served chat model: data -> tokenizer -> pretraining -> SFT -> serve.

    just demo            # trains on the first run (minutes on a laptop CPU), then serves
    just demo --fresh    # retrains even when runs/demo/model exists
    just demo --no-serve # stop after training and evaluation

The stages read configs/demo-pretrain.toml and configs/demo-sft.toml: the documented examples of
the options a user is most likely to change. The evaluation is configs/demo-eval.toml's, the
same that `just eval configs/demo-eval.toml` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_data
import torch

from astrai.config import EvalConfig, eval_config, read_toml, train_config
from astrai.data import data_config, format_summary, prepare
from astrai.eval import evaluate_tasks, model_of, write_results
from astrai.infer import native_bf16
from astrai.model import load_pretrained
from astrai.tokenizer import Tokenizer
from astrai.train import train

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
DEFAULT_RUN = "../runs/demo"  # the run folder as the configs name it, relative to configs/


def stage_line(name: str, started: float, detail: str = "") -> None:
    print(f"[demo] {name:<10} done in {time.time() - started:5.1f}s  {detail}", flush=True)


def rebase(value, run_dir: Path):
    """A demo TOML's data with its run folder moved to run_dir."""
    if isinstance(value, str) and value.startswith(DEFAULT_RUN):
        return str(run_dir) + value[len(DEFAULT_RUN) :]
    if isinstance(value, dict):
        return {k: rebase(v, run_dir) for k, v in value.items()}
    return [rebase(v, run_dir) for v in value] if isinstance(value, list) else value


def load_stage_config(name: str, run_dir: Path, max_steps: int | None, training: dict):
    """A demo TOML with its run folder moved to run_dir and `training`'s keys (precision,
    seed) set: (training config, prepare config)."""
    path = CONFIGS / name
    data = rebase(read_toml(path), run_dir) | training
    prepare_table = data.pop("prepare")
    if max_steps is not None:
        data["max_steps"] = max_steps
        data["checkpoint_every"] = 0
    return train_config(data, str(path), base=CONFIGS), data_config(
        prepare_table, f"{path} [prepare]", base=CONFIGS
    )


def last_metrics(run: Path) -> dict:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1]) if lines else {}


def train_model(
    run_dir: Path, records: int, max_steps: dict[str, int | None], training: dict
) -> Path:
    started = time.time()
    counts = demo_data.generate(run_dir / "data", seed=0, records=records)
    stage_line("data", started, ", ".join(f"{n} {k}" for k, n in counts.items()))

    started = time.time()
    texts = [
        json.loads(line)["text"]
        for line in (run_dir / "data" / "pretrain.jsonl").read_text().splitlines()
    ]
    tokenizer = Tokenizer.train(texts, vocab_size=512, split_digits=True)
    tokenizer.save_pretrained(run_dir / "tokenizer")
    stage_line("tokenizer", started, f"byte-level BPE, {tokenizer.vocab_size} tokens")

    stages = {
        stage: load_stage_config(f"demo-{stage}.toml", run_dir, max_steps[stage], training)
        for stage in ("pretrain", "sft")
    }
    for stage, (_, prep) in stages.items():
        started = time.time()
        summary = prepare(prep, log=None)
        stage_line("prepare", started, f"{stage}: " + format_summary(summary).splitlines()[-1])

    for stage, (cfg, _) in stages.items():
        started = time.time()
        train(cfg, resume=False)
        m = last_metrics(Path(cfg.out_dir))
        stage_line(stage, started, f"loss {m.get('loss', float('nan')):.4f}, "
                   f"{m.get('tokens_per_s', 0):,.0f} tok/s, {cfg.precision}")  # fmt: skip

    # Publish the model only once it is complete, so an interrupted run never leaves half a model.
    final, staging = run_dir / "model", run_dir / ".model.partial"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(Path(stages["sft"][0].out_dir) / "model", staging)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return final


def demo_eval_config(run_dir: Path, limit: int = 0) -> EvalConfig:
    """configs/demo-eval.toml with its run folder moved to run_dir (and each task cut to
    `limit` records when given)."""
    path = CONFIGS / "demo-eval.toml"
    table = rebase(read_toml(path)["eval"], run_dir)
    for task in table["tasks"]:
        task["limit"] = limit or task.get("limit", 0)
    return eval_config(table, f"{path} [eval]", base=CONFIGS)


def evaluate(model_dir: Path, run_dir: Path, limit: int = 0) -> list[dict]:
    """The tasks of configs/demo-eval.toml, as `just eval configs/demo-eval.toml` runs them:
    held-out accuracy (greedy, through the Engine) and held-out perplexity."""
    started = time.time()
    cfg = demo_eval_config(run_dir, limit)
    params, model_cfg = load_pretrained(model_dir)
    model = model_of(params, model_cfg, Tokenizer.from_pretrained(model_dir))
    results = evaluate_tasks(model, cfg)
    write_results(Path(cfg.out), str(model_dir), results, time.time() - started)
    generated, text = (r["metrics"] for r in results)
    for example in generated["examples"]:
        print(f"         {example['prompt']!r} -> {example['completion'].strip()!r}")
    stage_line(
        "evaluate",
        started,
        f"exact match {generated['accuracy']:.1%} on {generated['records']} held-out problems, "
        f"perplexity {text['perplexity']:.3f} ({text['bits_per_byte']:.3f} bits per byte) on "
        f"held-out text; all in {cfg.out}",
    )
    return results


def serve(model_dir: Path, port: int) -> None:
    url = f"http://127.0.0.1:{port}"
    print(
        f"""
Serving {model_dir} on {url} (Ctrl-C stops). Chat in your browser at {url}/ or try:

  curl {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "demo", "messages": [{{"role": "user", "content": "What is 37 + 48?"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="none")
  print(client.chat.completions.create(model="demo", messages=[{{"role": "user", "content": "What is 12 + 30?"}}]).choices[0].message.content)
""",
        flush=True,
    )
    serve_py = str(ROOT / "programs" / "serve.py")
    os.execv(
        sys.executable,
        [
            sys.executable,
            serve_py,
            "--model",
            str(model_dir),
            "--model-name",
            "demo",
            "--port",
            str(port),
        ],
    )


def training_precision(choice: str) -> str:
    """--precision as a training config's value: auto becomes what the device does fast."""
    if choice != "auto":
        return choice
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return "bfloat16" if native_bf16(device) else "float32"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fresh", action="store_true", help="retrain even if a model exists")
    parser.add_argument("--no-serve", action="store_true", help="stop after the evaluation")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "demo")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a seconds-long smoke run with a few steps (the model will not be useful)",
    )
    parser.add_argument(
        "--precision",
        choices=["float32", "bfloat16", "auto"],
        default="auto",
        help="training precision; auto (the default) = bfloat16 where the hardware multiplies "
        "it natively (docs/training.md: 2.5x faster on AVX-512 BF16), float32 elsewhere",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the training seed (the data stays the same)"
    )
    args = parser.parse_args()
    run_dir = args.run_dir.resolve()
    model_dir = run_dir / "model"
    started = time.time()
    if args.fresh or not (model_dir / "config.json").exists():
        steps = {"pretrain": 4, "sft": 4} if args.quick else {"pretrain": None, "sft": None}
        training = {"precision": training_precision(args.precision), "seed": args.seed}
        train_model(run_dir, 400 if args.quick else 20000, steps, training)
        evaluate(model_dir, run_dir, limit=20 if args.quick else 0)
        print(f"[demo] trained and evaluated in {time.time() - started:.0f}s", flush=True)
    else:
        print(f"[demo] reusing {model_dir} (just demo --fresh retrains)", flush=True)
    if not args.no_serve:
        serve(model_dir, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
