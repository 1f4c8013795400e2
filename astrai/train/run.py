"""What every way of training shares around `train_step`: starting a run (distributed setup, the
run folder, a fresh or resumed state, the reference model, the held-out split), `run_step`
(one optimizer step with its metrics, evaluation and checkpoint on their cadence),
`evaluate` (the held-out loss), `evaluate_on_tasks` (the [eval] tasks) and `save_checkpoint`.

The loop (astrai/train/loop.py) and GRPO's rounds (astrai/train/grpo.py) both build on this
module; neither imports the other's internals.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import msgspec
import torch

from astrai.config import ModelConfig, TrainConfig
from astrai.eval import evaluate_tasks, flat_metrics, model_of
from astrai.model import canonical_order, init_params, load_pretrained
from astrai.train.batches import BatchSource, open_batches, rows_per_rank, with_rank
from astrai.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_train_state,
    remove_partial_checkpoints,
    save_train_state,
)
from astrai.train.distill import check_distill, load_teacher, with_teacher_logps
from astrai.train.distributed import (
    DistInfo,
    all_reduce_sum_,
    barrier,
    broadcast_,
    init_distributed,
)
from astrai.train.losses import with_reference_logps
from astrai.train.metrics import (
    Throughput,
    append_metrics,
    progress_line,
    show_progress,
    truncate_metrics,
)
from astrai.train.mfu import run_mfu
from astrai.train.model_folder import run_tokenizer
from astrai.train.sharded import gathered, is_sharded, mesh_for, shard_params
from astrai.train.state import TrainState, init_train_state, model_params
from astrai.train.step import eval_step, micro_batches, train_step


class Run(NamedTuple):
    """What a run needs besides the state: fixed from start to end."""

    train_cfg: TrainConfig
    dist: DistInfo
    run_dir: Path
    reference: dict | None  # frozen params the dpo/grpo reference log-probs come from
    valid: BatchSource | None
    throughput: Throughput
    log: TextIO
    resumed: bool  # the state was read from a checkpoint (which therefore exists already)
    tokenizer: Any = None  # the [eval] tasks' tokenizer; None without tasks
    teacher: tuple[dict, ModelConfig] | None = None  # the [distill] teacher's params and config


# --- starting a run -------------------------------------------------------------------------


def start_run(
    train_cfg: TrainConfig,
    resume: bool | str,
    open_source: Callable[[DistInfo], BatchSource | None],
    log: TextIO,
) -> tuple[TrainState, BatchSource, Run]:
    """Set up this process's rank, the run folder and the data -> (state, source, run).

    resume: True continues from the latest checkpoint in out_dir (if any), a path from that
    checkpoint, False starts afresh (older checkpoints are removed). `open_source(dist)` gives
    the training batches for this rank.
    """
    check_distill(train_cfg)
    dist = init_distributed(train_cfg.backend, train_cfg.device)
    run_dir = Path(train_cfg.out_dir)
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_partial_checkpoints(run_dir)
        if resume is False:  # starting over: older checkpoints would be mistaken for this run's
            for old in list_checkpoints(run_dir):
                shutil.rmtree(old)
    barrier()
    ckpt = resume_point(run_dir, resume)
    source = open_source(dist)
    if source is None:
        raise ValueError("no training data: set [data] train (or source = 'synthetic')")
    state = start_state(train_cfg, dist, source.cursor, ckpt)
    reference = None
    if needs_reference(train_cfg):
        reference = state.params if state.lora else _frozen_copy(train_cfg, dist, state, ckpt)
    valid = open_batches(train_cfg, state.model_config, dist.rank, dist.world_size, "valid")
    teacher = None
    if train_cfg.distill.teacher:
        teacher = load_teacher(train_cfg.distill, state.model_config, dist.device)
    throughput = Throughput(state.step)
    tokenizer = run_tokenizer(train_cfg, "[eval] tasks") if train_cfg.eval.tasks else None
    run = Run(
        train_cfg,
        dist,
        run_dir,
        reference,
        valid,
        throughput,
        log,
        ckpt is not None,
        tokenizer,
        teacher,
    )
    if dist.is_main:
        truncate_metrics(run_dir / "metrics.jsonl", state.step)
        config_json = json.dumps(msgspec.to_builtins(train_cfg), indent=2)
        (run_dir / "train_config.json").write_text(config_json + "\n")
    return state, source, run


def resume_point(run_dir: Path, resume: bool | str) -> Path | None:
    """The checkpoint to resume from: the given path, the run's latest (resume=True), or none."""
    if isinstance(resume, (str, Path)) and resume not in ("", "latest"):
        if not (Path(resume) / "train_state.json").exists():
            raise FileNotFoundError(f"{resume}: not a training checkpoint (no train_state.json)")
        return Path(resume)
    return latest_checkpoint(run_dir) if resume else None


def start_state(
    train_cfg: TrainConfig, dist: DistInfo, source_cursor, ckpt: Path | None
) -> TrainState:
    """The checkpoint's state (its cursor moved to this rank), or a fresh one."""
    rows = rows_per_rank(train_cfg, dist.world_size)
    if ckpt is not None:
        mesh = shard_mesh(train_cfg, dist) if sharded(train_cfg, dist) else None
        state = load_train_state(ckpt, train_cfg, dist.device, mesh=mesh)
        return state._replace(cursor=with_rank(state.cursor, dist.rank, dist.world_size, rows))
    params, model_cfg = initial_params(train_cfg, dist.device)
    if sharded(train_cfg, dist):  # each rank keeps its part of rank 0's weights
        params = shard_params(params, shard_mesh(train_cfg, dist))
    else:
        broadcast_(list(params.values()))  # every rank starts from rank 0's weights
    return init_train_state(params, train_cfg, model_cfg, cursor=source_cursor)


def initial_params(train_cfg: TrainConfig, device) -> tuple[dict, ModelConfig]:
    """The params training starts from: `init_from`'s weights, or a fresh `[model]` at `seed`."""
    if train_cfg.init_from:
        params, cfg = load_pretrained(train_cfg.init_from, device=device)
        return canonical_order(params, cfg), cfg
    return init_params(train_cfg.model, seed=train_cfg.seed, device=device), train_cfg.model


def sharded(train_cfg: TrainConfig, dist: DistInfo) -> bool:
    """Whether this run shards its state: `parallel.mode = "sharded"` over several ranks (one
    process holds everything either way)."""
    return train_cfg.parallel.sharded and dist.world_size > 1


def shard_mesh(train_cfg: TrainConfig, dist: DistInfo):
    """The device mesh a sharded run spreads its state over (`parallel.replicas` copies)."""
    return mesh_for(dist.device, train_cfg.parallel.replicas)


def needs_reference(train_cfg: TrainConfig) -> bool:
    return train_cfg.kind == "dpo" or (train_cfg.kind == "grpo" and train_cfg.loss.grpo_kl_beta > 0)


def _frozen_copy(train_cfg: TrainConfig, dist: DistInfo, state: TrainState, ckpt) -> dict:
    """The reference model: the starting weights, which a resumed run reloads."""
    if ckpt is None:
        return {k: v.detach().clone() for k, v in state.params.items()}
    params = initial_params(train_cfg, dist.device)[0]
    return shard_params(params, shard_mesh(train_cfg, dist)) if sharded(train_cfg, dist) else params


# --- one step and what happens around it --------------------------------------------------------


def prepare_batch(batch: dict, state: TrainState, run: Run) -> dict:
    """Move a batch to the device and add the reference model's log-probs when the loss needs
    them (with LoRA the reference is the frozen base model itself, adapters off), or the
    [distill] teacher's."""
    batch = {
        k: v.to(run.dist.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }
    if run.teacher is not None:
        batch = with_teacher_logps(batch, run.teacher, run.train_cfg.distill.temperature)
    if run.reference is None:
        return batch
    cfg, opts = state.model_config, run.train_cfg.loss
    reference = gathered(run.reference) if sharded(run.train_cfg, run.dist) else run.reference
    return with_reference_logps(batch, run.train_cfg.kind, reference, cfg, opts)


def evaluate(state: TrainState, run: Run) -> float | None:
    """Mean loss over `eval_batches` batches of the held-out split (the same ones every time)."""
    if run.valid is None:
        return None
    cursor, total = run.valid.cursor, torch.zeros(2, device=run.dist.device)
    for _ in range(run.train_cfg.eval_batches):
        cursor, batch = run.valid.next(cursor)
        for micro in micro_batches(prepare_batch(batch, state, run), run.train_cfg.grad_accum):
            total += torch.stack(eval_step(state, micro))
    all_reduce_sum_([total])
    loss_sum, weight = total.tolist()
    return loss_sum / max(weight, 1e-12)


def evaluate_on_tasks(state: TrainState, run: Run) -> dict[str, float]:
    """The [eval] tasks on the current weights (LoRA merged), run by the main rank ->
    {"eval/TASK/METRIC": value}; the other ranks wait for it."""
    metrics = {}
    if run.dist.is_main:
        model = model_of(model_params(state), state.model_config, run.tokenizer)
        metrics = flat_metrics(evaluate_tasks(model, run.train_cfg.eval))
    barrier()
    return metrics


def save_checkpoint(state: TrainState, run: Run) -> None:
    """Rank 0 writes a whole state; every rank writes its part of a sharded one."""
    if is_sharded(state.params) or run.dist.is_main:
        save_train_state(run.run_dir, state, run.train_cfg.keep_checkpoints)


def run_step(state: TrainState, batch: dict, run: Run) -> tuple[TrainState, dict]:
    """One optimizer step with everything a run does around it -> (state, metrics). The state
    is donated, as to `train_step`."""
    cfg = run.train_cfg
    state, metrics = train_step(state, prepare_batch(batch, state, run))
    step = state.step
    run.throughput.update(metrics["tokens"])
    metrics = {"step": step, **metrics}
    due = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps
    eval_now = due and (run.valid is not None or bool(cfg.eval.tasks))
    log_now = run.dist.is_main and (step % cfg.log_every == 0 or eval_now or step == cfg.max_steps)
    if log_now:
        metrics["tokens_per_s"] = run.throughput.tokens_per_s()
        share = run_mfu(
            metrics["tokens_per_s"], state.model_config, batch, cfg.precision, state.device
        )
        if share is not None:
            metrics["mfu"] = share
    if eval_now:
        if run.valid is not None:
            metrics["eval_loss"] = evaluate(state, run)
        if cfg.eval.tasks:
            metrics.update(evaluate_on_tasks(state, run))
        run.throughput.reset_window()  # evaluation time is not training speed
    if log_now:
        append_metrics(run.run_dir / "metrics.jsonl", metrics)
        if cfg.progress:
            eta = run.throughput.eta(step, cfg.max_steps)
            line = progress_line(step, cfg.max_steps, metrics, metrics["tokens_per_s"], eta)
            show_progress(line, run.log, final=step == cfg.max_steps)
    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
        save_checkpoint(state, run)
    return state, metrics
