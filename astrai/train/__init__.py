"""Training: optimizers and schedules as pure functions, losses, train_step, the loop,
checkpoints, torch.distributed data parallel and sharded training, and GRPO with online rollouts."""

from astrai.eval.scoring import RewardError, load_reward
from astrai.model import token_logps
from astrai.train.batches import BatchSource, open_batches, synthetic_batch
from astrai.train.checkpoint import (
    export_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_train_state,
    save_train_state,
)
from astrai.train.distributed import DistInfo, all_reduce_sum_, init_distributed
from astrai.train.grpo import (
    Samples,
    build_batch,
    open_rollout,
    prompt_batches,
    request_seed,
    sample_group,
    score,
    step_batches,
    total_reward,
    train_round,
)
from astrai.train.loop import train
from astrai.train.losses import (
    LOSSES,
    dpo_loss,
    group_advantages,
    grpo_loss,
    loss_fn,
    seq_loss,
    sequence_logps,
    sft_loss,
    with_advantages,
    with_reference_logps,
)
from astrai.train.model_folder import export_model
from astrai.train.optim import (
    AdamState,
    MomentumState,
    MuonState,
    Optimizer,
    adamw,
    decay_mask,
    lion,
    make_optimizer,
    muon,
    muon_mask,
    orthogonalize,
    sgd,
)
from astrai.train.rewards import equation_format, exact_match
from astrai.train.run import Run, evaluate, prepare_batch, run_step, start_run
from astrai.train.schedules import SCHEDULES, lr_at
from astrai.train.sharded import gathered, shard_params
from astrai.train.sharded_checkpoint import save_sharded_train_state
from astrai.train.state import TrainState, init_train_state
from astrai.train.step import TrainingDiverged, eval_step, train_step

__all__ = [
    "LOSSES",
    "SCHEDULES",
    "AdamState",
    "BatchSource",
    "DistInfo",
    "MomentumState",
    "MuonState",
    "Optimizer",
    "RewardError",
    "Run",
    "Samples",
    "TrainState",
    "TrainingDiverged",
    "adamw",
    "all_reduce_sum_",
    "build_batch",
    "decay_mask",
    "dpo_loss",
    "equation_format",
    "eval_step",
    "evaluate",
    "exact_match",
    "export_checkpoint",
    "export_model",
    "gathered",
    "group_advantages",
    "grpo_loss",
    "init_distributed",
    "init_train_state",
    "latest_checkpoint",
    "lion",
    "list_checkpoints",
    "load_reward",
    "load_train_state",
    "loss_fn",
    "lr_at",
    "make_optimizer",
    "muon",
    "muon_mask",
    "open_batches",
    "open_rollout",
    "orthogonalize",
    "prepare_batch",
    "prompt_batches",
    "request_seed",
    "run_step",
    "sample_group",
    "save_sharded_train_state",
    "save_train_state",
    "score",
    "seq_loss",
    "sequence_logps",
    "sft_loss",
    "sgd",
    "shard_params",
    "start_run",
    "step_batches",
    "synthetic_batch",
    "token_logps",
    "total_reward",
    "train",
    "train_round",
    "train_step",
    "with_advantages",
    "with_reference_logps",
]
