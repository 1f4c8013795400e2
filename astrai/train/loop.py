"""The training loop as a function of a TrainConfig: `train(train_cfg) -> state`.

It starts (or resumes) a run (astrai/train/run.py), picks how one batch advances the state,
then repeats: next batch by cursor, advance. A batch of examples is one `run_step` (the
reference log-probs a dpo/grpo batch needs, `train_step`, metrics, evaluation and checkpoints
on their cadence); for grpo on a prompt dataset a batch of prompts is a round: rollouts through
the Engine, rewards, then several `run_step`s (astrai/train/grpo.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from astrai.config import TrainConfig
from astrai.model import model_config_from_json
from astrai.model.lora_folder import RUN_SUBFOLDER, AdapterError
from astrai.train import grpo
from astrai.train.batches import BatchSource, open_batches
from astrai.train.distributed import DistInfo, barrier
from astrai.train.model_folder import export_adapter, export_model
from astrai.train.run import Run, run_step, save_checkpoint, start_run
from astrai.train.sharded import full_params, is_sharded
from astrai.train.state import TrainState

# state, the cursor after the batch, the batch -> the state after it (the old one donated)
Advance = Callable[[TrainState, object, dict], TrainState]


def train(
    train_cfg: TrainConfig,
    resume: bool | str = True,
    batches: BatchSource | None = None,
    log: TextIO = sys.stderr,
) -> TrainState:
    """Run training to `max_steps` and return the final state.

    resume: True continues from the latest checkpoint in out_dir (if any), a path continues
    from that checkpoint, False starts afresh. batches replaces the configured data source.
    """
    rounds = batches is None and train_cfg.rollouts  # grpo on prompts: the loop samples
    state, source, run = start_run(train_cfg, resume, _source(train_cfg, batches, rounds), log)
    last_saved = state.step if run.resumed else None
    if rounds:
        advance = grpo.round_advance(run, grpo.open_rollout(state, train_cfg))
    else:
        advance = step_advance(run)
    while state.step < train_cfg.max_steps:
        cursor, batch = source.next(state.cursor)
        state = advance(state, cursor, batch)
        if train_cfg.checkpoint_every and state.step % train_cfg.checkpoint_every == 0:
            last_saved = state.step
    if last_saved != state.step:
        save_checkpoint(state, run)
    final = state
    if is_sharded(state.params):  # gathering the whole weights takes every rank
        final = state._replace(params=full_params(state.params))
    if run.dist.is_main:
        export_model(final, run.run_dir / "model", train_cfg.tokenizer)
        if final.lora is not None:
            _export_adapter(final, run.run_dir / RUN_SUBFOLDER, log)
    barrier()
    return state


def _export_adapter(state: TrainState, path: Path, log: TextIO) -> None:
    """The adapter folder beside the merged model; a family whose files cannot hold our
    adapters unmerged (see save_lora) keeps only the merged model, and the log says why."""
    try:
        export_adapter(state, path)
    except AdapterError as exc:
        print(f"no adapter folder written: {exc}", file=log)


def _source(train_cfg: TrainConfig, batches: BatchSource | None, rounds: bool):
    """dist -> this rank's training batches: the given ones, grpo's prompts, or `[data]`'s."""

    def open_source(dist: DistInfo) -> BatchSource | None:
        if batches is not None:
            return batches
        if rounds:
            return grpo.prompt_batches(train_cfg, dist.rank, dist.world_size)
        model_cfg = train_cfg.model or model_config_from_json(
            Path(train_cfg.init_from) / "config.json"
        )
        return open_batches(train_cfg, model_cfg, dist.rank, dist.world_size, "train")

    return open_source


def step_advance(run: Run) -> Advance:
    """A batch of examples: one optimizer step."""

    def advance(state: TrainState, cursor, batch: dict) -> TrainState:
        return run_step(state._replace(cursor=cursor), batch, run)[0]

    return advance
