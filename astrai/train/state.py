"""The train state: one typed pytree that `train_step` takes and gives back.

Everything a run needs to continue exactly where it stopped lives in it (and in a checkpoint):
the params, the LoRA adapters when only those are trained, the optimizer moments, the counters,
the RNG state and the data cursor, plus the two configs as plain fields. `init_train_state`
builds one, fresh; `load_train_state` (astrai/train/checkpoint.py) builds one with it and
fills it from a checkpoint, so a state is constructed in one place, here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from astrai.config import ModelConfig, TrainConfig
from astrai.model import init_lora, merge_lora
from astrai.train.optim import OptState, make_optimizer


class TrainState(NamedTuple):
    """Immutable as a tuple; its large tensors (params, adapters, moments) are donated to
    `train_step`, which updates them in place. Change a field with `state._replace(...)`."""

    params: dict[str, torch.Tensor]  # the model's weights; frozen when `lora` is set
    lora: dict | None  # {"scale": tensor, "weights": {key: {"A", "B"}}}: trained instead
    opt: OptState  # the optimizer's state over `trainable`: AdamState, MomentumState
    step: int  # optimizer steps taken, skipped ones included
    skipped: int  # steps skipped for a non-finite loss or gradient
    bad_streak: int  # skipped steps in a row
    rng: torch.Tensor  # torch.Generator state: the loss's random draws (NEFTune noise)
    cursor: Any  # the batch source's cursor, JSON-able: where the next batch starts
    model_config: ModelConfig
    train_config: TrainConfig

    @property
    def trainable(self) -> dict:
        """The tree the optimizer updates: the params, or the LoRA adapters' weights."""
        return self.params if self.lora is None else self.lora["weights"]

    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device


def init_train_state(
    params: dict[str, torch.Tensor],
    train_cfg: TrainConfig,
    model_cfg: ModelConfig | None = None,
    lora: dict | None = None,
    cursor: Any = None,
) -> TrainState:
    """A fresh train state. model_cfg defaults to train_cfg.model; with `lora.rank > 0` (or a
    given `lora` tree) only the adapters are trained and `params` stay frozen."""
    model_cfg = model_cfg or train_cfg.model
    if model_cfg is None:
        raise ValueError("init_train_state needs model_cfg when train_cfg.model is not set")
    device = next(iter(params.values())).device
    if lora is None and train_cfg.lora.rank:
        lc = train_cfg.lora
        lora = init_lora(params, model_cfg, lc.rank, lc.alpha, tuple(lc.targets), lc.seed)
    trainable = params if lora is None else lora["weights"]
    generator = torch.Generator(device=device).manual_seed(train_cfg.seed)
    return TrainState(
        params=params,
        lora=lora,
        opt=make_optimizer(train_cfg.optimizer, trainable).init(trainable),
        step=0,
        skipped=0,
        bad_streak=0,
        rng=generator.get_state(),
        cursor=cursor,
        model_config=model_cfg,
        train_config=train_cfg,
    )


def model_params(state: TrainState) -> dict[str, torch.Tensor]:
    """The weights the model runs with: the params, LoRA adapters merged in (a new dict then)."""
    return state.params if state.lora is None else merge_lora(state.params, state.lora)
