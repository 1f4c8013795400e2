"""`train_step(state, batch) -> (state, metrics)` over the `TrainState` of astrai/train/state.py.

One step:
split the batch into micro-batches, take gradients (`torch.func.grad_and_value`, or
torch.autograd with the same contract; see `grad_engine`), sum them
(weighted by each micro-batch's token or sequence count) and all-reduce across ranks, clip by
global norm, skip the update if anything is non-finite, apply the optimizer at the schedule's LR.
"""

from __future__ import annotations

import contextlib
import math

import msgspec
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from astrai.config import ModelConfig, TrainConfig
from astrai.infer.allocator import keep_freed_memory
from astrai.model import products
from astrai.model.forward import compile_layer
from astrai.train.compiling import compiled, note, should_compile
from astrai.train.distributed import all_reduce_sum_
from astrai.train.losses import distill_loss, loss_fn, with_advantages
from astrai.train.optim import make_optimizer
from astrai.train.product_choice import choose_products
from astrai.train.schedules import lr_at
from astrai.train.sharded import gathered, is_sharded, local, replicas_of
from astrai.train.state import TrainState


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


# --- gradients ---------------------------------------------------------------------------------


def _objective(model_cfg: ModelConfig, train_cfg: TrainConfig, compiled_layer=None):
    """trainable -> (loss * weight, (loss, metrics)); weight-scaled so micro-batches add up.
    compiled_layer: astrai.model.forward.compile_layer()'s function, run for every layer."""
    autocast = train_cfg.precision == "bfloat16"

    def objective(trainable, params, lora_scale, batch, generator):
        lora = None if lora_scale is None else {"scale": lora_scale, "weights": trainable}
        model_params = params if lora is not None else trainable
        checkpoint = train_cfg.activation_checkpointing
        if is_sharded(model_params):
            # Weights are gathered as the layers read them; checkpointing each layer drops its
            # gathered weights after its forward and gathers them again for its backward.
            model_params, checkpoint = gathered(model_params), True
        device_type = batch_device(batch).type
        ctx = (
            torch.autocast(device_type, dtype=torch.bfloat16)
            if autocast
            else contextlib.nullcontext()
        )
        with ctx:
            if train_cfg.distill.teacher:
                loss, metrics = distill_loss(
                    model_params,
                    model_cfg,
                    _with_teacher(batch),
                    train_cfg.loss,
                    train_cfg.distill,
                    lora,
                    checkpoint,
                    generator,
                    compiled_layer,
                )
            else:
                loss, metrics = loss_fn(
                    model_params,
                    model_cfg,
                    batch,
                    train_cfg.kind,
                    train_cfg.loss,
                    lora,
                    checkpoint,
                    generator,
                    compiled_layer,
                )
        loss = loss.float()
        return loss * metrics["weight"], (loss.detach(), metrics)

    return objective


def _with_teacher(batch: dict) -> dict:
    if "teacher_logps" not in batch:
        raise ValueError(
            "a [distill] run's batches need the teacher's log-probs, batch['teacher_logps']:"
            " add them with astrai.train.distill.with_teacher_logps"
        )
    return batch


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


def grad_fn(model_cfg: ModelConfig, train_cfg: TrainConfig, device: torch.device):
    """The (possibly compiled) gradient function for these configs, built once and reused."""
    key = msgspec.json.encode([model_cfg, train_cfg, str(device)])
    if key not in _GRAD_FNS:
        engine = grad_engine(train_cfg)
        fn = _grad_and_value(_objective(model_cfg, train_cfg), engine)
        compile_it = should_compile(train_cfg, device)
        if compile_it and engine == "func":
            note("astrai: torch.compile cannot run inside torch.func (grad_engine = func); "
                 "training runs in eager mode")  # fmt: skip
        elif compile_it:
            # One decoder layer compiled and reused for every layer (model/shared_layer.py).
            layer = compile_layer()
            fast = _grad_and_value(_objective(model_cfg, train_cfg, layer), engine)
            fn = compiled(fast, fn, "the decoder layer")
        _GRAD_FNS[key] = fn
    return _GRAD_FNS[key]


def _grad_and_value(objective, engine: str):
    if engine == "func":
        return torch.func.grad_and_value(objective, has_aux=True)
    return _autograd_grad_and_value(objective)


def grad_engine(train_cfg: TrainConfig) -> str:
    """ "func" or "autograd". Both compute the same gradients of the same objective. "auto"
    takes torch.autograd: compiled layers run under it (torch.compile cannot trace inside a
    torch.func transform), and in eager mode torch.func's transform accumulates gradients out
    of place, which costs time on CPU (docs/training.md, "Gradient engines", has the figures);
    activation checkpointing needs it too."""
    return "autograd" if train_cfg.grad_engine == "auto" else train_cfg.grad_engine


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


def _accumulate(state: TrainState, batch, generator):
    """Weighted gradient sum over micro-batches -> (grad leaves, spec, stat names, stats)."""
    train_cfg, lora = state.train_config, state.lora
    lora_scale = None if lora is None else lora["scale"]
    fn = grad_fn(state.model_config, train_cfg, state.device)
    total, names, stats = None, None, None
    for micro in micro_batches(batch, train_cfg.grad_accum):
        micro = _to_device(micro, state.device)
        _choose_products(state.model_config, train_cfg, state.device, micro)
        grads, (_, (loss, metrics)) = fn(
            state.trainable, state.params, lora_scale, micro, generator
        )
        leaves, spec = tree_flatten(grads)
        leaves = [local(g) for g in leaves]  # sharded: this rank's part, summed over ranks
        weight = metrics["weight"].to(state.device)
        # Averages over the global batch are sums of (value * weight) divided by the summed weight.
        tokens = metrics["tokens"].to(state.device)
        values = {"loss": loss * weight, "weight": weight, "tokens": tokens}
        for k, v in metrics.items():
            if k not in values:
                values[k] = v.detach().float().to(state.device) * weight
        row = torch.stack([values[k].float().reshape(()) for k in sorted(values)])
        if total is None:
            total, names, stats = leaves, sorted(values), row
        else:
            torch._foreach_add_(total, leaves)
            stats = stats + row
    return total, spec, names, stats


def _choose_products(cfg: ModelConfig, train_cfg: TrainConfig, device, micro: dict) -> None:
    """The float32 products' libraries (model/products.py) at the first micro-batch's tokens
    and the model's widest matrix, as this machine chose them (product_choice.py), before
    anything is compiled."""
    if device.type != "cpu" or train_cfg.precision != "float32" or products.ONEDNN:
        return
    rows = max(
        (v.numel() for v in micro.values() if torch.is_tensor(v) and v.dim() == 2), default=0
    )
    if rows:
        choose_products(rows, cfg.hidden_size, cfg.intermediate_size or 4 * cfg.hidden_size)


def train_step(state: TrainState, batch: dict | list[dict]) -> tuple[TrainState, dict]:
    """One optimizer step on a batch (a dict of [B, ...] tensors, split into grad_accum
    micro-batches, or a list of micro-batches) -> (new state, metrics as Python numbers).

    The state is donated, as with JAX's donate_argnums: the params (or LoRA adapters) and the
    optimizer moments are updated in place, so the new state holds the same tensors as the old
    one, now changed. The caller must not use the old state again (clone what it wants to keep).
    A non-finite loss or gradient leaves the tensors untouched and counts a skipped step;
    `max_bad_steps` skipped steps in a row raise TrainingDiverged.
    """
    train_cfg = state.train_config
    # A step's temporaries come back from the C heap rather than as fresh zeroed pages: 3% of
    # a bf16 step of the benchmark's small model on a 2-core Intel Xeon (once per process).
    keep_freed_memory()
    generator = torch.Generator(device=state.device)
    generator.set_state(state.rng)
    if train_cfg.kind == "grpo" and isinstance(batch, dict):
        batch = with_advantages(batch, train_cfg.loss)  # on whole groups, before splitting
    grads, spec, names, stats = _accumulate(state, batch, generator)
    copies = replicas_of(state.trainable) if is_sharded(state.trainable) else None
    raw_norm, stats = _reduce(grads, stats, copies, train_cfg.bucket_mb)
    # One host sync per step: the finiteness check, clipping and the metrics need the numbers.
    numbers = torch.cat([raw_norm.reshape(1), stats]).tolist()
    summed = dict(zip(names, numbers[1:]))
    w = max(summed["weight"], 1e-12)
    norm_value = numbers[0] / w
    metrics = {k: v / w for k, v in summed.items() if k not in ("weight", "tokens")}
    metrics |= {"tokens": summed["tokens"], "grad_norm": norm_value}
    lr = lr_at(state.step, train_cfg.schedule, train_cfg.optimizer.lr, train_cfg.max_steps)
    metrics["lr"] = lr
    stepped = state._replace(step=state.step + 1, rng=generator.get_state())
    if not (math.isfinite(norm_value) and math.isfinite(metrics["loss"])):
        new = _skip(stepped, train_cfg.max_bad_steps)
        return new, {**metrics, "skipped": new.skipped, "step_skipped": True}
    # Dividing by the total weight and clipping are one factor, which the optimizer applies as
    # it reads the gradients (inside the fused AdamW kernel: no extra pass over them).
    max_norm = train_cfg.optimizer.max_grad_norm
    clip = max_norm / (norm_value + 1e-6) if max_norm and norm_value > max_norm else 1.0
    optimizer = make_optimizer(train_cfg.optimizer, state.trainable)
    grads = tree_unflatten(grads, spec)
    trainable, opt = optimizer.update(
        local(state.trainable), grads, local(state.opt), lr, grad_scale=clip / w
    )
    if copies:  # the shards were updated in place; keep their DTensors
        trainable, opt = state.trainable, state.opt._replace(count=opt.count)
    if state.lora is None:
        new = stepped._replace(params=trainable, opt=opt, bad_streak=0)
    else:
        new = stepped._replace(lora={**state.lora, "weights": trainable}, opt=opt, bad_streak=0)
    return new, {**metrics, "skipped": new.skipped}


def _reduce(grads: list, stats: torch.Tensor, copies: int | None, bucket_mb: float):
    """Sum gradients and stats over ranks -> (global gradient norm, summed stats). The grads
    are sums of weight * gradient; the norm of their mean is that norm / the total weight.
    copies: None for whole gradients, else how many ranks hold each shard (hybrid sharding)."""
    if copies is None:
        all_reduce_sum_([*grads, stats], bucket_mb)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))), stats
    # Sharded: the reduce-scatter already summed each shard; add up the shards' squared norms,
    # each counted once though `copies` ranks hold it.
    squares = torch.stack(torch._foreach_norm(grads)).square().sum() if grads else stats[:1] * 0
    squares = squares / copies
    totals = torch.cat([squares.reshape(1), stats])
    all_reduce_sum_([totals])
    return totals[0].sqrt(), totals[1:]


def _skip(state: TrainState, max_bad_steps: int) -> TrainState:
    """The state after a step whose update was not applied; too many in a row raise."""
    state = state._replace(skipped=state.skipped + 1, bad_streak=state.bad_streak + 1)
    if state.bad_streak >= max_bad_steps:
        raise TrainingDiverged(
            f"{state.bad_streak} steps in a row (up to step {state.step}) had a non-finite "
            f"loss or gradient; the state was left as it was before them. Lower optimizer.lr, "
            "check the data, or raise max_bad_steps."
        )
    return state


@torch.no_grad()
def eval_step(state: TrainState, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss * weight, weight) on one batch, without noise, checkpointing or any update."""
    train_cfg = state.train_config
    quiet = msgspec.structs.replace(
        train_cfg,
        activation_checkpointing=False,
        loss=msgspec.structs.replace(train_cfg.loss, neftune_alpha=0.0),
    )
    lora_scale = None if state.lora is None else state.lora["scale"]
    if quiet.kind == "grpo":
        batch = with_advantages(batch, quiet.loss)
    objective = _objective(state.model_config, quiet)
    weighted, (_, metrics) = objective(state.trainable, state.params, lora_scale, batch, None)
    return weighted.float(), metrics["weight"].to(weighted.device).float()
