"""The layouts a float CPU matrix can take for inference, each built from the canonical
[out, in] weight. Which of them run here is astrai/infer/support.py's to say, which is fastest
prepare_params' to measure."""

from __future__ import annotations

import torch

from astrai.infer.float_gemv import gemv_matrix
from astrai.infer.packed import pack
from astrai.infer.panels import panel_matrix
from astrai.kernels.huge_pages import contiguous_in_huge_pages


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """The same matrix as a transposed view of [in, out]-contiguous storage."""
    return contiguous_in_huge_pages(w.transpose(-1, -2)).transpose(-1, -2)


# kept [out, in]; stored [in, out]-contiguous; packed for oneDNN (a PackedMatrix); kept [out, in]
# for our C kernel at few rows (a GemvMatrix); in panels of 16 output rows for our C kernel at
# every row count (a PanelMatrix)
LAYOUTS = {
    "rows": lambda w: w,
    "columns": _transposed,
    "packed": pack,
    "gemv": gemv_matrix,
    "panels": panel_matrix,
}
