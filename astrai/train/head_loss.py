"""The lm_head and the next-token cross-entropy as one function that works through the rows
in chunks, for training (eager steps, and the head of compiled ones).

Unfused, a step of the benchmark's small model (8 x 256 tokens, 32,000 words) writes four
[2048, 32000] float32 tensors (262 MB each: the logits, their log-softmax, the zero-filled
gradient of the NLL and the log-softmax's backward), and in bf16 two casts of them more; on
CPU that pass over memory cost more than the head's three matrix products in bf16. Here each
chunk of rows makes its logits, their loss and their gradient (softmax minus the smoothed
one-hot) while they are still in cache, and only that gradient, in the products' dtype, is
kept for the backward's two products.

The maths is the unfused one: the logits are the head's product in the products' dtype (bf16
under autocast), the softmax runs in float32 over them, and the gradient is rounded to the
products' dtype before the backward products, as autograd does through `logits.float()`.
A head traced by torch.compile keeps the plain form, which inductor fuses itself
(`fused_head_applies`); compiled training compiles the decoder layer only, so its head runs
here. Where our C kernels are built, each chunk's loss and gradient is one call
(astrai/kernels/cross_entropy.c) and the chunks are taller.
"""

from __future__ import annotations

import math
import sys
import threading

import torch

from astrai.config import ModelConfig
from astrai.infer.allocator import MMAP_THRESHOLD
from astrai.kernels.cross_entropy import cross_entropy_grad_, kernel_takes
from astrai.model import IGNORE
from astrai.model.products import by_onednn, product_t

CHUNK_ELEMENTS = 1 << 22  # logits per chunk: 16 MB in float32, which a large L2/L3 holds
# With our C kernel (one pass a row, each row in L2) the chunk only sets the product's height,
# and taller products run faster: a bf16 step of the benchmark's small model took 0.97 s in
# chunks of 131 rows, 0.91 s in 524 and 0.89 s in one, on a 2-core Intel Xeon with AMX.
KERNEL_CHUNK_ELEMENTS = 1 << 24
# Where oneDNN multiplies float32 (model/products.py), a chunk's logits are a new tensor, then
# copied into the gradient buffer: up to glibc's mmap threshold they come from the heap that
# keep_freed_memory keeps, past it from freshly mapped pages every chunk.
ONEDNN_CHUNK_BYTES = MMAP_THRESHOLD - (1 << 20)


def fused_head_applies(cfg: ModelConfig, weight) -> bool:
    """Whether the chunked head can stand in for lm_head + cross-entropy: eager (a traced step
    is fused by inductor), a plain head (no scaling or capping of the logits), a whole weight
    (not a sharded one)."""
    return (
        not torch.compiler.is_compiling()
        and cfg.logits_scaling == 1.0
        and cfg.final_logit_softcapping is None
        and isinstance(weight, torch.Tensor)
        and not _sharded(weight)
    )


def _sharded(weight: torch.Tensor) -> bool:
    # a DTensor exists only once its module is loaded; importing it here would cost every
    # program ~0.6 s of start-up
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(weight, module.DTensor)


def head_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T, labels, ignore_index=IGNORE, label_smoothing=...,
    reduction="sum") in float32. hidden [..., H], weight [V, H], labels [...]."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    dtype = _product_dtype(hidden, weight)
    return _HeadCrossEntropy.apply(hidden, weight, labels, label_smoothing, dtype)[0]


def _product_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would multiply in: autocast's, or the tensors' own."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but the head weight is {weight.dtype}")
    return hidden.dtype


class _HeadCrossEntropy(torch.autograd.Function):
    """(loss sum, d loss / d logits); the second is an output rather than a saved intermediate
    so that torch.func can transform the function too."""

    @staticmethod
    def forward(hidden, weight, labels, label_smoothing, dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = _operands(hidden, weight, dtype)
            return _loss_and_logit_grad(h, w, labels.reshape(-1), label_smoothing)

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden, weight, _, _, dtype = inputs
        ctx.mark_non_differentiable(output[1])
        # no zero-filled [N, V] tensor for the second output's gradient, which is never used
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, output[1])
        ctx.dtype = dtype

    @staticmethod
    def backward(ctx, loss_grad, _):
        hidden, weight, grad = ctx.saved_tensors
        with torch.autocast(hidden.device.type, enabled=False):
            # the casts again (for bf16 one pass over the head), rather than holding copies
            h, w = _operands(hidden, weight, ctx.dtype)
            grad_hidden = product_t(grad, w.t(), "input").mul_(loss_grad)
            grad_hidden = grad_hidden.to(hidden.dtype).reshape(hidden.shape)
            grad_weight = product_t(grad.t(), h.t(), "weight").mul_(loss_grad).to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _operands(hidden, weight, dtype):
    """hidden as [N, H] rows and the weight, both in the products' dtype."""
    return hidden.reshape(-1, hidden.shape[-1]).to(dtype), weight.to(dtype)


def _loss_and_logit_grad(h, w, labels, smoothing):
    """(summed loss in float32, d loss / d logits [N, V] in h's dtype), chunk by chunk."""
    rows, vocab = h.shape[0], w.shape[0]
    grad = _gradient_buffer(rows, vocab, h.dtype, h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    in_kernel = kernel_takes(grad, labels)
    most = (KERNEL_CHUNK_ELEMENTS if in_kernel else CHUNK_ELEMENTS) // vocab
    onednn = by_onednn("forward", h, w)
    if onednn:  # its product comes as a new tensor: on the C heap, not freshly mapped pages
        most = min(most, ONEDNN_CHUNK_BYTES // (vocab * h.element_size()))
    # chunks of even height: no short last one that reads the whole head for a few rows
    step = math.ceil(rows / math.ceil(rows / max(1, most)))
    for start in range(0, rows, step):
        part = slice(start, start + step)
        if onednn:  # no output argument: the product is copied in
            rounded = grad[part].copy_(product_t(h[part], w, "forward"))
        else:
            rounded = torch.mm(h[part], w.t(), out=grad[part])
        if in_kernel:  # one pass a row in C, no casts
            total += cross_entropy_grad_(rounded, labels[part], IGNORE, smoothing)
            continue
        logits = rounded.float()  # the same tensor in float32: worked on in place
        total += _chunk_loss_to_grad_(logits, labels[part], smoothing)
        if logits is not rounded:
            rounded.copy_(logits)
    return total, grad


# The last gradient buffer handed out, for the next call to reuse once nothing else holds it.
# It is the step's largest tensor (131 MB for 2048 rows of 32,000 bf16 logits), above the 32
# MiB that glibc's malloc keeps when freed, so each step would map and zero fresh pages for it:
# 3-5% of a bf16 step of the benchmark's small model on a 2-core Intel Xeon. (Were it reused
# too early, autograd's version counter would refuse the backward that read it.)
_SPARE: list[torch.Tensor] = []
_SPARE_LOCK = threading.Lock()


def _gradient_buffer(rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
    """An uninitialised [rows, vocab] tensor: the previous call's if its backward has run and
    freed its graph (then only _SPARE refers to it) and it was made in the same mode (an
    inference tensor cannot be written outside inference mode), else a new one, kept as the
    spare."""
    inference = torch.is_inference_mode_enabled()
    with _SPARE_LOCK:
        for spare in _SPARE:
            same = spare.shape == (rows, vocab) and spare.dtype == dtype and spare.device == device
            if same and spare.is_inference() == inference and spare._use_count() == 1:
                return spare
        fresh = torch.empty(rows, vocab, dtype=dtype, device=device)
        _SPARE[:] = [fresh]
        return fresh


def _chunk_loss_to_grad_(logits: torch.Tensor, labels: torch.Tensor, smoothing: float):
    """The chunk's summed loss; logits [c, V] float32 become d loss / d logits in place."""
    valid = labels != IGNORE
    target = labels.clamp(min=0)[:, None]
    top = logits.amax(-1, keepdim=True)  # subtracted before exp, as log_softmax does
    picked = logits.gather(1, target).squeeze(1)
    mean = logits.mean(-1) if smoothing else None
    probs = logits.sub_(top).exp_()
    norm = probs.sum(-1, keepdim=True)
    log_norm = (top + norm.log()).squeeze(1)  # logsumexp of the row
    per_row = log_norm - picked  # the NLL
    if smoothing:  # F.cross_entropy's smoothing: eps times the mean NLL over the vocabulary
        per_row = (1.0 - smoothing) * per_row + smoothing * (log_norm - mean)
    probs.div_(norm)
    probs.scatter_add_(1, target, probs.new_full(target.shape, smoothing - 1.0))
    if smoothing:
        probs.sub_(smoothing / probs.shape[-1])
    probs.mul_(valid[:, None])
    return (per_row * valid).sum()
