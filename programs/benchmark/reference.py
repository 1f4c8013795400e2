"""The reference side: transformers' model of the folder's model_type (LlamaForCausalLM for
most shapes) on the same weights folder, driven the way its documentation shows (generate with a KV cache, a plain forward, AdamW training)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def load_reference(folder: Path, dtype: torch.dtype, device: torch.device):
    """The folder's model class (AutoModelForCausalLM reads config.json), in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy generation of exactly new_tokens per prompt (prompts of equal length, so the
    batch needs no padding)."""
    device = model.device
    ids = torch.tensor(prompts, device=device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        use_cache=True,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    return out[:, ids.shape[1] :].tolist()


@torch.inference_mode()
def forward(model, tokens: torch.Tensor, last_only: bool) -> torch.Tensor:
    """All logits with no cache, or (last_only) what generate's prefill does: fill a KV cache
    and keep the last position's logits."""
    if last_only:
        return model(input_ids=tokens, use_cache=True, logits_to_keep=1).logits
    return model(input_ids=tokens, use_cache=False).logits


def train_step_fn(
    model, lr: float, weight_decay: float, betas, max_grad_norm: float, bf16: bool = False
) -> Callable:
    """batch -> loss: forward with labels, backward, clip, torch.optim.AdamW with torch's
    default implementation, weight decay on the same tensors as ours (matrices, not norms or
    the embedding). bf16: the forward (and so the backward) under bf16 autocast, as the
    transformers Trainer does with bf16=True; weights and optimizer stay float32."""
    model.train()
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in named if not (p.dim() >= 2 and "embed_tokens" not in n)]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)

    def step(batch: dict) -> float:
        ids = batch["input_ids"]
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # a host sync, as ours has one per step

    return step
