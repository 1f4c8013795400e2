"""Whether our kernels' passes at one activation row ask for the weights ahead in software,
timed once a process per product kind and set in the kernels (astrai/kernels/gemv.c,
`astrai_ahead_at_one_row`).

At one row a pass streams the weights at the memory's pace, and whether the hardware's
prefetchers keep up alone or the asks pay for their issue slots differs by CPU: on a 2-core AMD
Zen 5 the float passes read 1.07-1.35x as fast without them and the 4- and 8-bit ones
1.02-1.04x, on a 2-core Intel Xeon the bfloat16 pass read 13% faster with them. The two ways
alternate over matrices streamed from memory, as a decode step reads them; the values are the
same either way.
"""

from __future__ import annotations

import functools

import torch

from astrai.kernels import gemv
from astrai.timing import best_of_rounds, pass_seconds

TIMED_BYTES = 64 << 20  # weights each way streams: more than most caches
SHAPE = (4096, 1024)  # [out, in] of the timed matrices


def _product(kind: int) -> tuple:
    """(run(x), bytes) of one SHAPE matrix of `kind` through our kernel; the weights' values
    do not change how fast it reads them."""
    out_features, in_features = SHAPE
    if kind in (gemv.FLOAT32, gemv.BFLOAT16):
        dtype = torch.float32 if kind == gemv.FLOAT32 else torch.bfloat16
        w = torch.full(SHAPE, 0.01, dtype=dtype)
        return gemv.float_product(w), w.numel() * w.element_size()
    if kind == gemv.INT8:
        q = torch.ones(SHAPE, dtype=torch.int8)
        return gemv.int8_product(gemv.pack_int8(q), torch.ones(out_features), SHAPE), q.numel()
    q = torch.full(SHAPE, 9, dtype=torch.uint8)
    scale = torch.full((out_features, in_features // 128), 0.01)
    nibbles, scale_bits, zero_bits = gemv.pack_int4(q, scale, torch.zeros_like(scale), 128)
    return gemv.int4_product(nibbles, scale_bits, zero_bits, 128, SHAPE), q.numel() // 2


@functools.cache
def one_row_ahead(kind: int) -> bool:
    """Whether passes of `kind` (gemv.FLOAT32, BFLOAT16, INT8, INT4) at one row ask for the
    weights ahead: the faster way here, timed now and left set in the kernels."""
    first, size = _product(kind)
    runs = [first] + [_product(kind)[0] for _ in range(max(TIMED_BYTES // size, 1) - 1)]
    x = torch.full((1, SHAPE[1]), 0.5)

    def seconds(on: bool) -> float:
        gemv.one_row_ahead(kind, on)
        return pass_seconds(runs, x)

    best = best_of_rounds({True: True, False: False}, seconds)
    ahead = best[True] < best[False]
    gemv.one_row_ahead(kind, ahead)
    return ahead
