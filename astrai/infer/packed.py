"""Float matrices in oneDNN's blocked layout: torch's own CPU matmul library, with the weight
reordered once at load into the tiles its kernels read, as inductor's frozen graphs do.

Whether it beats the plain layouts on the running machine is measured at load
(astrai.infer.prepare), like every other layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astrai.model.products import mkldnn_linear

DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class PackedMatrix:
    """W [out, in] held in oneDNN's layout; `linear(x)` is x @ W.T, in W's dtype."""

    packed: torch.Tensor  # opaque (layout torch._mkldnn), read only by oneDNN's linear
    shape: torch.Size
    kernel: str = "onednn"

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        # x of any leading shape, as is: reshaping around the call costs two ops a product
        return mkldnn_linear(x, self.packed)


def pack(w: torch.Tensor) -> PackedMatrix:
    """w [out, in] (float32 or bfloat16, on the CPU) reordered for oneDNN; raises where torch
    was built without it or the dtype has no kernel here."""
    if w.device.type != "cpu" or w.dtype not in DTYPES or not torch.backends.mkldnn.is_available():
        raise RuntimeError(f"oneDNN cannot pack a {w.dtype} matrix on {w.device}")
    # batch_size None: one packing serves every row count (decode steps and prompt chunks)
    return PackedMatrix(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None), w.shape)
