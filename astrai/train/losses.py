"""Loss functions: `loss_fn(params, cfg, batch, kind) -> (loss, metrics)`.

Each loss is the mean over its own unit (trained tokens for seq/sft, pairs for dpo, tokens or
sequences for grpo) and reports that unit's count as `metrics["weight"]`, so micro-batches and
data-parallel ranks can be combined into the exact mean over the whole global batch.
Batch layouts are in docs/training.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from astrai.config import LossConfig, ModelConfig
from astrai.model import IGNORE, forward, hidden_states, lm_head, token_logps
from astrai.train.head_loss import fused_head_applies, head_cross_entropy_sum


def _forward(
    params,
    cfg: ModelConfig,
    ids,
    batch,
    opts: LossConfig,
    lora,
    checkpoint,
    generator,
    compiled_layer,
):
    """Logits in float32 and the MoE aux term already scaled by its coefficient.
    compiled_layer: the compiled function every layer runs through, or None (see
    astrai.model.forward.compile_layer)."""
    hidden, aux_term = _hidden(
        params, cfg, ids, batch, opts, lora, checkpoint, generator, compiled_layer
    )
    return lm_head(params, cfg, hidden).float(), aux_term


def _hidden(
    params,
    cfg: ModelConfig,
    ids,
    batch,
    opts: LossConfig,
    lora,
    checkpoint,
    generator,
    compiled_layer,
):
    """The final hidden states and the MoE aux term already scaled by its coefficient."""
    hidden, aux = hidden_states(
        params,
        cfg,
        ids,
        positions=batch.get("positions"),
        doc_ids=batch.get("doc_ids"),
        lora=lora,
        neftune_alpha=opts.neftune_alpha,
        generator=generator,
        checkpoint=checkpoint,
        compiled_layer=compiled_layer,
    )
    coef = cfg.router_aux_loss_coef if opts.aux_loss_coef is None else opts.aux_loss_coef
    aux_term = coef * aux if cfg.ffn_type == "moe" else None
    return hidden, aux_term


def _cross_entropy_sum(
    params, cfg, ids, labels, batch, opts, lora, checkpoint, generator, compiled_layer
):
    """The summed next-token cross-entropy over the labelled positions, and the aux term. In
    eager steps the head and the loss run as one chunked function (astrai/train/head_loss.py):
    the same maths without the passes over [tokens, vocabulary] float32 tensors."""
    head = params.get("lm_head.weight", params["model.embed_tokens.weight"])
    if fused_head_applies(cfg, head):
        hidden, aux_term = _hidden(
            params, cfg, ids, batch, opts, lora, checkpoint, generator, compiled_layer
        )
        return head_cross_entropy_sum(hidden, head, labels, opts.label_smoothing), aux_term
    logits, aux_term = _forward(
        params, cfg, ids, batch, opts, lora, checkpoint, generator, compiled_layer
    )
    total = F.cross_entropy(
        logits.flatten(0, 1),
        labels.flatten(),
        ignore_index=IGNORE,
        label_smoothing=opts.label_smoothing,
        reduction="sum",
    )
    return total, aux_term


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    """Summed (or per-token mean) log-probability of each row's labelled tokens [B]."""
    logp = token_logps(logits, labels).sum(-1)
    if reduction == "mean":
        logp = logp / (labels != IGNORE).sum(-1).clamp(min=1)
    return logp


def _with_aux(loss, aux_term, metrics):
    if aux_term is not None:
        metrics["aux_loss"] = aux_term.detach()
        loss = loss + aux_term
    return loss, metrics


# --- next-token prediction --------------------------------------------------------------------


def shifted_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """labels[:, t] = input_ids[:, t + 1]; the last position has no target."""
    labels = torch.full_like(input_ids, IGNORE)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


def seq_loss(
    params, cfg, batch, opts, lora=None, checkpoint=False, generator=None, compiled_layer=None
):
    """Next-token cross entropy with label smoothing; labels default to the shifted inputs."""
    ids = batch["input_ids"]
    labels = batch["labels"] if "labels" in batch else shifted_labels(ids)
    total, aux_term = _cross_entropy_sum(
        params, cfg, ids, labels, batch, opts, lora, checkpoint, generator, compiled_layer
    )
    count = (labels != IGNORE).sum()
    loss = total / count.clamp(min=1)
    metrics = {"weight": count.float(), "tokens": torch.tensor(float(ids.numel()))}
    return _with_aux(loss, aux_term, metrics)


def sft_loss(
    params, cfg, batch, opts, lora=None, checkpoint=False, generator=None, compiled_layer=None
):
    """Supervised fine-tuning: the same cross entropy, only on the tokens whose labels are set
    (the assistant's turns); labels are required because the prompt must not be trained on."""
    if "labels" not in batch:
        raise ValueError("sft batches need 'labels' (-100 on prompt tokens)")
    return seq_loss(params, cfg, batch, opts, lora, checkpoint, generator, compiled_layer)


# --- direct preference optimisation ----------------------------------------------------------


def _pad_to(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    return F.pad(t, (0, length - t.shape[1]), value=value)


def stack_pairs(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen rows then rejected rows in one [2B, T] batch, right-padded, so one forward pass
    scores both (padding sits after every labelled token, so causal attention ignores it)."""
    T = max(batch["chosen_ids"].shape[1], batch["rejected_ids"].shape[1])
    ids = torch.cat([_pad_to(batch[k], T, 0) for k in ("chosen_ids", "rejected_ids")])
    labels = torch.cat([_pad_to(batch[k], T, IGNORE) for k in ("chosen_labels", "rejected_labels")])
    return ids, labels


def dpo_loss(
    params, cfg, batch, opts, lora=None, checkpoint=False, generator=None, compiled_layer=None
):
    """DPO (Rafailov et al.) with conservative label smoothing, or IPO (Azar et al.).

    Needs "ref_chosen_logps" / "ref_rejected_logps" [B] from the frozen reference model
    (`with_reference_logps` adds them), reduced the same way (`logp_reduction`).
    """
    if "ref_chosen_logps" not in batch:
        raise ValueError(
            "dpo batches need ref_chosen_logps/ref_rejected_logps (with_reference_logps)"
        )
    ids, labels = stack_pairs(batch)
    logits, aux_term = _forward(
        params, cfg, ids, {}, opts, lora, checkpoint, generator, compiled_layer
    )
    policy_chosen, policy_rejected = sequence_logps(logits, labels, opts.logp_reduction).chunk(2)
    chosen = policy_chosen - batch["ref_chosen_logps"]
    rejected = policy_rejected - batch["ref_rejected_logps"]
    margin = chosen - rejected
    beta = opts.dpo_beta
    if opts.dpo_loss == "ipo":
        losses = (margin - 1.0 / (2.0 * beta)) ** 2
    else:
        ls = opts.dpo_label_smoothing
        losses = -F.logsigmoid(beta * margin) * (1 - ls) - F.logsigmoid(-beta * margin) * ls
    metrics = {
        "weight": torch.tensor(float(margin.shape[0])),
        "tokens": torch.tensor(float(ids.numel())),
        "reward_chosen": (beta * chosen).detach().mean(),
        "reward_rejected": (beta * rejected).detach().mean(),
        "reward_accuracy": (margin > 0).float().mean(),
    }
    return _with_aux(losses.mean(), aux_term, metrics)


# --- group relative policy optimisation ------------------------------------------------------


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps); no division when scale is False.

    The std is the population std, so a group of one gets advantage 0 instead of NaN.
    """
    _, group = torch.unique(group_ids, return_inverse=True)
    n = torch.bincount(group).float()
    rewards = rewards.float()
    mean = torch.zeros_like(n).index_add(0, group, rewards) / n
    centred = rewards - mean[group]
    if not scale:
        return centred
    var = torch.zeros_like(n).index_add(0, group, centred**2) / n
    return centred / (var.sqrt()[group] + eps)


def with_advantages(batch: dict, opts: LossConfig) -> dict:
    """Add group-normalised "advantages" from "rewards" and "group_ids" when missing.

    Call it on whole groups (before splitting into micro-batches or ranks): a group's mean and
    std are only right when all its members are present.
    """
    if "advantages" in batch or "rewards" not in batch:
        return batch
    adv = group_advantages(batch["rewards"], batch["group_ids"], opts.grpo_scale_rewards)
    return {**batch, "advantages": adv}


def grpo_loss(
    params, cfg, batch, opts, lora=None, checkpoint=False, generator=None, compiled_layer=None
):
    """GRPO (Shao et al.): clipped policy ratio against the rollout policy times the advantage,
    plus beta * KL to the reference model with the k3 estimator exp(d) - d - 1, d = ref - new.

    Without "old_logps" the rollouts are taken as on-policy (ratio 1, gradient of log-prob).
    """
    batch = with_advantages(batch, opts)
    ids, labels = batch["input_ids"], batch["labels"]
    logits, aux_term = _forward(
        params, cfg, ids, batch, opts, lora, checkpoint, generator, compiled_layer
    )
    mask = (labels != IGNORE).float()
    logp = token_logps(logits, labels)
    old = batch.get("old_logps")
    old = logp.detach() if old is None else old
    ratio = torch.exp(logp - old)
    adv = batch["advantages"].float()[:, None]
    clipped = ratio.clamp(1.0 - opts.grpo_clip_low, 1.0 + opts.grpo_clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    metrics = {"tokens": torch.tensor(float(ids.numel()))}
    if opts.grpo_kl_beta:
        if "ref_logps" not in batch:
            raise ValueError("grpo with grpo_kl_beta > 0 needs ref_logps (with_reference_logps)")
        d = batch["ref_logps"] - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + opts.grpo_kl_beta * kl
        metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).detach()
    if opts.grpo_averaging == "token":
        weight = mask.sum()
        loss = (per_token * mask).sum() / weight.clamp(min=1)
    else:
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
        weight = torch.tensor(float(ids.shape[0]))
    metrics["weight"] = weight
    metrics["clip_fraction"] = (
        ((ratio - clipped).abs() > 0).float() * mask
    ).sum() / mask.sum().clamp(min=1)
    return _with_aux(loss, aux_term, metrics)


# --- distillation -----------------------------------------------------------------------------


def distill_loss(
    params,
    cfg,
    batch,
    opts,
    distill,
    lora=None,
    checkpoint=False,
    generator=None,
    compiled_layer=None,
):
    """(1 - ce_weight) x KL(teacher || student) + ce_weight x cross entropy, both the mean over
    the positions that have a label; batch["teacher_logps"] [B, T, vocab] holds the teacher's
    log-probabilities at distill.temperature (distill.py adds them)."""
    ids = batch["input_ids"]
    labels = batch["labels"] if "labels" in batch else shifted_labels(ids)
    logits, aux_term = _forward(
        params, cfg, ids, batch, opts, lora, checkpoint, generator, compiled_layer
    )
    mask = labels != IGNORE
    count = mask.sum()
    teacher = batch["teacher_logps"][mask]
    student = logits[mask]
    t = distill.temperature
    kl_rows = (teacher.exp() * (teacher - F.log_softmax(student / t, dim=-1))).sum(-1)
    kl = kl_rows.sum() * t * t / count.clamp(min=1)
    ce = F.cross_entropy(student, labels[mask], reduction="sum") / count.clamp(min=1)
    loss = (1.0 - distill.ce_weight) * kl + distill.ce_weight * ce
    agreement = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
    metrics = {
        "weight": count.float(),
        "tokens": torch.tensor(float(ids.numel())),
        "kl": kl.detach(),
        "ce": ce.detach(),
        "teacher_agreement": agreement.detach(),
    }
    return _with_aux(loss, aux_term, metrics)


LOSSES = {"seq": seq_loss, "sft": sft_loss, "dpo": dpo_loss, "grpo": grpo_loss}


def loss_fn(
    params,
    cfg: ModelConfig,
    batch: dict,
    kind: str = "seq",
    opts: LossConfig | None = None,
    lora: dict | None = None,
    checkpoint: bool = False,
    generator: torch.Generator | None = None,
    compiled_layer=None,
):
    """The training objective of `kind` ("seq", "sft", "dpo", "grpo") -> (loss, metrics).
    compiled_layer: astrai.model.forward.compile_layer()'s function, run for every layer, or None."""
    if kind not in LOSSES:
        raise ValueError(f"kind must be one of {sorted(LOSSES)}, got {kind!r}")
    return LOSSES[kind](
        params, cfg, batch, opts or LossConfig(), lora, checkpoint, generator, compiled_layer
    )


@torch.no_grad()
def with_reference_logps(
    batch: dict, kind: str, ref_params, cfg: ModelConfig, opts: LossConfig, ref_lora=None
) -> dict:
    """Add the frozen reference model's log-probs a dpo or grpo batch needs (when missing)."""
    if kind == "dpo" and "ref_chosen_logps" not in batch:
        ids, labels = stack_pairs(batch)
        logits = forward(ref_params, cfg, ids, lora=ref_lora).float()
        chosen, rejected = sequence_logps(logits, labels, opts.logp_reduction).chunk(2)
        return {**batch, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}
    if kind == "grpo" and opts.grpo_kl_beta and "ref_logps" not in batch:
        logits = forward(
            ref_params,
            cfg,
            batch["input_ids"],
            positions=batch.get("positions"),
            doc_ids=batch.get("doc_ids"),
            lora=ref_lora,
        ).float()
        return {**batch, "ref_logps": token_logps(logits, batch["labels"])}
    return batch
