"""Float matrices in panels of 16 output rows (astrai/kernels/panels.c), multiplied by our C
kernel at every row count: each vector of weights it loads serves 16 outputs of up to 16
activation rows, so a decode step of many requests reads the weights at the memory's speed
where a product of rows by dot products is bound by its reads from the caches.

Whether it beats the other layouts on the running machine is measured at load
(astrai.infer.prepare), like every other layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from astrai.infer.float_gemv import prompt_product
from astrai.kernels import gemv
from astrai.kernels.huge_pages import contiguous_in_huge_pages
from astrai.model.layers import cast

PANEL = 16  # output rows a panel holds (panels.c)
# Rows past which a product goes to the prompt's product (float_gemv.prompt_product) on the
# weights unpacked for the call, which reads and writes them once, a few percent of a prompt
# chunk's product. On a 2-core AMD Zen 5 the kernel led oneDNN's packed layout at 64 rows (1B
# shape, 920-1,000 against 890-900 GFLOP/s), trailed it at 512 (0.85-0.95x) and further at
# 2,048, where the activations no longer stay in cache (bfloat16 0.82-0.98x, float32
# 0.70-0.92x). The 0.5B shape's prefill of 4 x 512 tokens, every matrix in panels, against
# the layouts chosen without them (two processes alternating): past 512 rows float32 1.02x,
# bfloat16 0.98x; past 256 rows 0.85x and 0.92x (a float32 MLP's pieces of ~430 rows unpacked
# the weights each); the kernel at every row count 0.95x and 0.71x (then with float32 copies
# of bfloat16 activations and outputs, which it no longer makes).
PROMPT_ROWS = 512


@dataclass(frozen=True, eq=False)
class PanelMatrix:
    """W [out, in] in panels; `linear(x)` is x @ W.T in x's dtype."""

    panels: torch.Tensor
    shape: torch.Size
    run: Callable[[torch.Tensor], torch.Tensor]
    kernel: str = "panels"

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        road = prompt_road(self.panels.dtype)
        if road is not None and x.numel() > PROMPT_ROWS * x.shape[-1]:
            return road(x, unpacked(self.panels, self.shape))
        return cast(self.run(x), x.dtype)


@functools.cache
def prompt_road(dtype: torch.dtype) -> Callable | None:
    """The prompt's product of `dtype` matrices (float_gemv.prompt_product, timed once a
    process), or None where torch has none here (oneDNN held below AVX-512 refuses bfloat16),
    and the kernel takes prompts too."""
    try:
        return prompt_product(dtype)
    except RuntimeError:
        return None


def panel_layout(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] as panels: float32 [panels][in][16], bfloat16 [panels][in / 2][16][2] (the
    pairs of inputs vdpbf16ps multiplies side by side); the last panel padded with zero rows."""
    out, in_features = w.shape
    w = F.pad(w, (0, 0, 0, -out % PANEL))
    if w.dtype == torch.bfloat16:
        return contiguous_in_huge_pages(w.view(-1, PANEL, in_features // 2, 2).transpose(1, 2))
    return contiguous_in_huge_pages(w.view(-1, PANEL, in_features).transpose(1, 2))


def unpacked(panels: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The [out, in] matrix of `shape` that panel_layout laid out as `panels`."""
    out, in_features = shape
    # a bfloat16 pair moves as one 32-bit word: 4.6x as fast as moving the halves apart
    words = panels.view(torch.int32) if panels.dtype == torch.bfloat16 else panels
    words = words.reshape(panels.shape[0], -1, PANEL).transpose(1, 2).contiguous()
    return words.view(panels.dtype).reshape(-1, in_features)[:out]


def panel_matrix(w: torch.Tensor) -> PanelMatrix:
    """w [out, in] (float32 or bfloat16 on the CPU, in a multiple of 16) for our panel kernel."""
    if w.dtype not in (torch.float32, torch.bfloat16) or w.device.type != "cpu":
        raise RuntimeError(f"the panel kernel takes float32 or bfloat16 on the CPU, not {w.dtype}")
    prompt_road(w.dtype)  # timed now, as weights are prepared, not in a request's first step
    panels = panel_layout(w)
    return PanelMatrix(panels, w.shape, gemv.panel_product(panels, tuple(w.shape)))
