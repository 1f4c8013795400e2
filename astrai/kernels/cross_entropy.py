"""The cross-entropy of a chunk of logits and its gradient in one C call (cross_entropy.c),
for the chunked head of training (astrai/train/head_loss.py).

torch's eight ops over a chunk cost more than the head's product in bfloat16 on a CPU that
multiplies it natively: on a 2-core Intel Xeon with AMX, 139 ms a step of the benchmark's small
model (2048 rows of 32,000 logits) against the product's 40-71 ms.
"""

from __future__ import annotations

import torch

from astrai.kernels.build import kernel_library, why_absent

DTYPES = (torch.float32, torch.bfloat16)


def cross_entropy_grad_(
    logits: torch.Tensor, labels: torch.Tensor, ignore: int, smoothing: float
) -> torch.Tensor | None:
    """logits [rows, vocab] (float32 or bfloat16, contiguous, on the CPU) overwritten by
    d loss / d logits of F.cross_entropy(logits.float(), labels, ignore_index=ignore,
    label_smoothing=smoothing, reduction="sum"); returns that summed loss (float32), or None
    where the kernel does not take them (the logits unchanged). A NaN or infinite logit makes
    the loss NaN."""
    if not kernel_takes(logits, labels):
        return None
    labels = labels.contiguous()
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32)
    code = kernel_library().astrai_cross_entropy_grad(
        logits.data_ptr(), int(logits.dtype == torch.bfloat16), rows, vocab,
        labels.data_ptr(), ignore, smoothing, loss.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if code == 2:
        raise ValueError(f"a label is outside [0, {vocab}) and is not the ignore index {ignore}")
    if code:
        raise MemoryError(f"no memory for a row of {vocab} float32 values (code {code})")
    return loss.sum()


def kernel_takes(logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """Whether cross_entropy_grad_ runs on these: logits [rows, vocab] float32 or bfloat16,
    contiguous, on a CPU where the kernels built, vocab a multiple of 8; int64 labels [rows]."""
    return (
        logits.dim() == 2
        and logits.dtype in DTYPES
        and logits.is_cpu
        and logits.is_contiguous()
        and logits.shape[1] % 8 == 0
        and labels.dtype == torch.int64
        and labels.shape == logits.shape[:1]
        and not torch.compiler.is_compiling()
        and why_absent() is None
    )
