"""Training: optimizers and schedules as pure functions, losses, train_step, the loop,
checkpoints and torch.distributed data parallelism."""

from astrai.train.batches import BatchSource, open_batches, synthetic_batch
from astrai.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_train_state,
    save_train_state,
)
from astrai.train.distributed import DistInfo, all_reduce_sum_, init_distributed
from astrai.train.loop import Run, evaluate, export_model, prepare_batch, run_step, train
from astrai.train.losses import (
    LOSSES,
    dpo_loss,
    group_advantages,
    grpo_loss,
    loss_fn,
    seq_loss,
    sequence_logps,
    sft_loss,
    token_logps,
    with_advantages,
    with_reference_logps,
)
from astrai.train.optim import Optimizer, adamw, decay_mask, lion, make_optimizer, sgd
from astrai.train.schedules import SCHEDULES, lr_at
from astrai.train.step import TrainingDiverged, eval_step, init_train_state, train_step

__all__ = [
    "LOSSES",
    "SCHEDULES",
    "BatchSource",
    "DistInfo",
    "Optimizer",
    "Run",
    "TrainingDiverged",
    "adamw",
    "all_reduce_sum_",
    "decay_mask",
    "dpo_loss",
    "eval_step",
    "evaluate",
    "export_model",
    "group_advantages",
    "grpo_loss",
    "init_distributed",
    "init_train_state",
    "latest_checkpoint",
    "lion",
    "list_checkpoints",
    "load_train_state",
    "loss_fn",
    "lr_at",
    "make_optimizer",
    "open_batches",
    "prepare_batch",
    "run_step",
    "save_train_state",
    "seq_loss",
    "sequence_logps",
    "sft_loss",
    "sgd",
    "synthetic_batch",
    "token_logps",
    "train",
    "train_step",
    "with_advantages",
    "with_reference_logps",
]
