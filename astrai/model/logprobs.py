"""Log-probabilities of given tokens under the model's logits: what the losses, GRPO's policy
ratio and evaluation's perplexity all read."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # the label of a position that is neither trained nor scored


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[:, t] | prefix) per position [B, T]; zero where labels == IGNORE."""
    flat = -F.cross_entropy(
        logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none"
    ).view(labels.shape)
    return flat * (labels != IGNORE)
