"""The train state as one pytree, and `train_step(state, batch) -> (state, metrics)`.

The state holds params (and the LoRA tree when adapters are trained), the optimizer moments,
counters, the RNG state and the data cursor, plus the two configs as static fields. One step:
split the batch into micro-batches, take gradients (`torch.func.grad_and_value`, or
torch.autograd with the same contract; see `grad_engine`), sum them
(weighted by each micro-batch's token or sequence count) and all-reduce across ranks, clip by
global norm, skip the update if anything is non-finite, apply the optimizer at the schedule's LR.
"""

from __future__ import annotations

import contextlib
import math
import sys

import msgspec
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from astrai.config import ModelConfig, TrainConfig
from astrai.model import init_lora
from astrai.train.distributed import all_reduce_sum_
from astrai.train.losses import loss_fn, with_advantages
from astrai.train.optim import make_optimizer
from astrai.train.schedules import lr_at


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def init_train_state(
    params: dict[str, torch.Tensor],
    train_cfg: TrainConfig,
    model_cfg: ModelConfig | None = None,
    lora: dict | None = None,
    cursor: dict | None = None,
) -> dict:
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
    return {
        "params": params,
        "lora": lora,
        "opt": make_optimizer(train_cfg.optimizer, trainable).init(trainable),
        "step": 0,
        "skipped": 0,
        "bad_streak": 0,
        "rng": generator.get_state(),
        "cursor": cursor,
        "model_config": model_cfg,
        "train_config": train_cfg,
    }


# --- gradients ---------------------------------------------------------------------------------


def _objective(model_cfg: ModelConfig, train_cfg: TrainConfig):
    """trainable -> (loss * weight, (loss, metrics)); weight-scaled so micro-batches add up."""
    autocast = train_cfg.precision == "bfloat16"

    def objective(trainable, params, lora_scale, batch, generator):
        lora = None if lora_scale is None else {"scale": lora_scale, "weights": trainable}
        model_params = params if lora is not None else trainable
        device_type = batch_device(batch).type
        ctx = (
            torch.autocast(device_type, dtype=torch.bfloat16)
            if autocast
            else contextlib.nullcontext()
        )
        with ctx:
            loss, metrics = loss_fn(
                model_params,
                model_cfg,
                batch,
                train_cfg.kind,
                train_cfg.loss,
                lora,
                train_cfg.activation_checkpointing,
                generator,
            )
        loss = loss.float()
        return loss * metrics["weight"], (loss.detach(), metrics)

    return objective


def _autograd_grad_and_value(objective):
    """The same contract as torch.func.grad_and_value(objective, has_aux=True), through
    torch.autograd: activation checkpointing relies on saved-tensor hooks, which torch.func
    transforms do not support."""

    def run(trainable, *args):
        leaves, spec = tree_flatten(trainable)
        leaves = [t.detach().requires_grad_(True) for t in leaves]
        out, aux = objective(tree_unflatten(leaves, spec), *args)
        grads = torch.autograd.grad(out, leaves, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
        return tree_unflatten(grads, spec), (out.detach(), aux)

    return run


_GRAD_FNS: dict[bytes, object] = {}


def grad_fn(model_cfg: ModelConfig, train_cfg: TrainConfig):
    """The (possibly compiled) gradient function for these configs, built once and reused."""
    key = msgspec.json.encode([model_cfg, train_cfg])
    if key not in _GRAD_FNS:
        objective = _objective(model_cfg, train_cfg)
        if grad_engine(train_cfg) == "func":
            fn = torch.func.grad_and_value(objective, has_aux=True)
        else:
            fn = _autograd_grad_and_value(objective)
        _GRAD_FNS[key] = _compiled(fn) if train_cfg.compile else fn
    return _GRAD_FNS[key]


def grad_engine(train_cfg: TrainConfig) -> str:
    """ "func" or "autograd". Both compute the same gradients of the same objective. "auto"
    takes torch.func when compiling (AOTAutograd traces it into one graph) and torch.autograd
    in eager mode, where torch.func's transform accumulates gradients out of place and measured
    up to a third slower on CPU; activation checkpointing always needs torch.autograd."""
    if train_cfg.grad_engine != "auto":
        return train_cfg.grad_engine
    return "func" if train_cfg.compile and not train_cfg.activation_checkpointing else "autograd"


def _compiled(fn):
    """torch.compile(fn), falling back to eager (with one clear message) if compiling fails."""
    # fullgraph: a graph break inside a torch.func transform would silently run it all eagerly;
    # failing loudly leads to the message below instead.
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)
    use_eager = False

    def run(*args):
        nonlocal use_eager
        if not use_eager:
            try:
                # RoPE reads the largest position as a Python int; let it stay in the graph.
                with torch._dynamo.config.patch(capture_scalar_outputs=True):
                    return compiled(*args)
            except Exception as exc:  # a missing compiler or backend shows up on the first call
                use_eager = True
                print(
                    f"astrai: torch.compile failed ({type(exc).__name__}: {str(exc)[:200]}); "
                    "training continues in eager mode. Set compile = false to silence this.",
                    file=sys.stderr,
                )
        return fn(*args)

    return run


# --- the step ----------------------------------------------------------------------------------


def batch_device(batch) -> torch.device:
    return next(v.device for v in batch.values() if isinstance(v, torch.Tensor))


def micro_batches(batch: dict | list, n: int) -> list[dict]:
    """A list of micro-batches as given, or a dict batch split into n along the batch axis."""
    if isinstance(batch, list):
        return batch
    if n == 1:
        return [batch]
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    if rows < n:
        raise ValueError(f"a batch of {rows} rows cannot be split into grad_accum={n} parts")
    parts = [{} for _ in range(n)]
    for key, value in batch.items():
        pieces = value.tensor_split(n) if isinstance(value, torch.Tensor) else [value] * n
        for part, piece in zip(parts, pieces):
            part[key] = piece
    return parts


def _to_device(batch: dict, device: torch.device) -> dict:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


def _accumulate(state: dict, batch, generator):
    """Weighted gradient sum over micro-batches -> (grad leaves, spec, stat names, stats)."""
    model_cfg, train_cfg = state["model_config"], state["train_config"]
    lora = state["lora"]
    trainable = state["params"] if lora is None else lora["weights"]
    lora_scale = None if lora is None else lora["scale"]
    device = next(iter(state["params"].values())).device
    fn = grad_fn(model_cfg, train_cfg)
    total, names, stats = None, None, None
    for micro in micro_batches(batch, train_cfg.grad_accum):
        micro = _to_device(micro, device)
        grads, (_, (loss, metrics)) = fn(trainable, state["params"], lora_scale, micro, generator)
        leaves, spec = tree_flatten(grads)
        weight = metrics["weight"].to(device)
        # Averages over the global batch are sums of (value * weight) divided by the summed weight.
        values = {"loss": loss * weight, "weight": weight, "tokens": metrics["tokens"].to(device)}
        for k, v in metrics.items():
            if k not in values:
                values[k] = v.detach().float().to(device) * weight
        row = torch.stack([values[k].float().reshape(()) for k in sorted(values)])
        if total is None:
            total, names, stats = leaves, sorted(values), row
        else:
            torch._foreach_add_(total, leaves)
            stats = stats + row
    return total, spec, names, stats


def train_step(state: dict, batch: dict | list[dict]) -> tuple[dict, dict]:
    """One optimizer step on a batch (a dict of [B, ...] tensors, split into grad_accum
    micro-batches, or a list of micro-batches) -> (new state, metrics as Python numbers).

    The state is donated: params and moments are updated in place. A non-finite loss or
    gradient leaves them untouched and counts a skipped step; `max_bad_steps` skipped steps in
    a row raise TrainingDiverged.
    """
    train_cfg = state["train_config"]
    device = next(iter(state["params"].values())).device
    generator = torch.Generator(device=device)
    generator.set_state(state["rng"])
    if train_cfg.kind == "grpo" and isinstance(batch, dict):
        batch = with_advantages(batch, train_cfg.loss)  # on whole groups, before splitting
    grads, spec, names, stats = _accumulate(state, batch, generator)
    all_reduce_sum_([*grads, stats], train_cfg.bucket_mb)
    # The grads are sums of weight * gradient; the norm of their mean is norm / total weight.
    raw_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    # One host sync per step: the finiteness check, clipping and the metrics need the numbers.
    numbers = torch.cat([raw_norm.reshape(1), stats]).tolist()
    summed = dict(zip(names, numbers[1:]))
    w = max(summed["weight"], 1e-12)
    norm_value = numbers[0] / w
    metrics = {k: v / w for k, v in summed.items() if k not in ("weight", "tokens")}
    metrics |= {"tokens": summed["tokens"], "grad_norm": norm_value}
    step = state["step"]
    lr = lr_at(step, train_cfg.schedule, train_cfg.optimizer.lr, train_cfg.max_steps)
    finite = math.isfinite(norm_value) and math.isfinite(metrics["loss"])
    new = {**state, "step": step + 1, "rng": generator.get_state()}
    if not finite:
        new |= {"skipped": state["skipped"] + 1, "bad_streak": state["bad_streak"] + 1}
        if new["bad_streak"] >= train_cfg.max_bad_steps:
            raise TrainingDiverged(
                f"{new['bad_streak']} steps in a row (up to step {step + 1}) had a non-finite "
                f"loss or gradient; the state was left as it was before them. Lower optimizer.lr, "
                "check the data, or raise max_bad_steps."
            )
        return new, {**metrics, "lr": lr, "skipped": new["skipped"], "step_skipped": True}
    # Divide by the total weight and clip in one pass over the gradients.
    max_norm = train_cfg.optimizer.max_grad_norm
    clip = max_norm / (norm_value + 1e-6) if max_norm and norm_value > max_norm else 1.0
    torch._foreach_mul_(grads, clip / w)
    lora = state["lora"]
    trainable = state["params"] if lora is None else lora["weights"]
    optimizer = make_optimizer(train_cfg.optimizer, trainable)
    trainable, opt_state = optimizer.update(
        trainable, tree_unflatten(grads, spec), state["opt"], lr
    )
    if lora is None:
        new["params"] = trainable
    else:
        new["lora"] = {**lora, "weights": trainable}
    new |= {"opt": opt_state, "bad_streak": 0}
    return new, {**metrics, "lr": lr, "skipped": new["skipped"]}


@torch.no_grad()
def eval_step(state: dict, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss * weight, weight) on one batch, without noise, checkpointing or any update."""
    train_cfg = state["train_config"]
    quiet = msgspec.structs.replace(
        train_cfg,
        activation_checkpointing=False,
        loss=msgspec.structs.replace(train_cfg.loss, neftune_alpha=0.0),
    )
    lora = state["lora"]
    trainable = state["params"] if lora is None else lora["weights"]
    lora_scale = None if lora is None else lora["scale"]
    if quiet.kind == "grpo":
        batch = with_advantages(batch, quiet.loss)
    objective = _objective(state["model_config"], quiet)
    weighted, (_, metrics) = objective(trainable, state["params"], lora_scale, batch, None)
    return weighted.float(), metrics["weight"].to(weighted.device).float()
