"""Evaluation: perplexity, generation and multiple-choice tasks, listed in an `[eval]` table and
run by `just eval`, during training (`eval_every`) and by the demo. See docs/evaluation.md.

    model = model_of(params, cfg, tokenizer)
    results = evaluate_tasks(model, load_eval_config("eval.toml"))
"""

from astrai.eval.loglik import Scored, rolling_pairs, score_pairs
from astrai.eval.report import evaluate_tasks, flat_metrics, format_table, write_results
from astrai.eval.scoring import RewardError, load_reward, pass_at_k, scorer_for
from astrai.eval.tasks import Model, checksum, continuation_pair, model_of, read_records, run_task

__all__ = [
    "Model",
    "RewardError",
    "Scored",
    "checksum",
    "continuation_pair",
    "evaluate_tasks",
    "flat_metrics",
    "format_table",
    "load_reward",
    "model_of",
    "pass_at_k",
    "read_records",
    "rolling_pairs",
    "run_task",
    "score_pairs",
    "scorer_for",
    "write_results",
]
