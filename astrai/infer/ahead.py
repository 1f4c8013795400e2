"""Whether our float kernel's passes at one activation row ask for the weights ahead in
software, timed once a process per weight dtype and set in the kernels (astrai/kernels/gemv.c,
`astrai_ahead_at_one_row`).

At one row a pass streams the weights at the memory's pace, and whether the hardware's
prefetchers keep up alone or the asks pay for their issue slots differs by CPU: on a 2-core AMD
Zen 5 the float passes read 1.06-1.35x as fast without them, on a 2-core Intel Xeon the
bfloat16 pass read 13% faster with them. The two ways alternate over matrices streamed from
memory, as a decode step reads them; the values are the same either way. The 4- and 8-bit
passes keep their own way (not asking): on the AMD Zen 5 not asking made a step 1.02-1.04x
as fast, a difference a timing this short told apart no better than a coin there.
"""

from __future__ import annotations

import functools

import torch

from astrai.kernels import gemv
from astrai.timing import best_of_rounds, pass_seconds

TIMED_BYTES = 128 << 20  # weights each way streams: past the caches, and long enough a pass
# that the margin stands out of the noise (at 64 MB the choice flipped between processes)
MARGIN = 1.05  # how much faster the other way must be to replace the kernels' own
# [out, in] of the timed matrices, in turn: short rows and long ones, as an MLP's two sides
# (whose gains differ: on the AMD Zen 5 not asking read 896 x 4864 float32 matrices 1.35x as
# fast, 9728 x 896 ones 1.02-1.10x)
SHAPES = ((4096, 1024), (1024, 4096))


def _product(kind: int, shape: tuple[int, int]) -> tuple:
    """(run(x), bytes) of one float matrix of `kind` and `shape` through our kernel; the
    weights' values do not change how fast it reads them."""
    w = torch.full(shape, 0.01, dtype=torch.float32 if kind == gemv.FLOAT32 else torch.bfloat16)
    return gemv.float_product(w), w.numel() * w.element_size()


def _streamed(kind: int) -> list:
    """Products of `kind` over TIMED_BYTES of SHAPES in turn, each taking its own row of 0.5s
    (whatever x it is given), to multiply one after the other as a decode step does."""
    runs, size = [], 0
    while size < TIMED_BYTES:
        shape = SHAPES[len(runs) % len(SHAPES)]
        run, nbytes = _product(kind, shape)
        x = torch.full((1, shape[1]), 0.5)
        runs.append(lambda _, run=run, x=x: run(x))
        size += nbytes
    return runs


@functools.cache
def one_row_ahead(kind: int) -> bool:
    """Whether the float passes of `kind` (gemv.FLOAT32 or BFLOAT16) at one row ask for the
    weights ahead: the kernels' own way unless the other is MARGIN faster here, timed now and
    left set in the kernels. The margin keeps a choice within the timing's noise from flipping
    between processes."""
    own, runs = gemv.one_row_ahead(kind), _streamed(kind)

    def seconds(on: bool) -> float:
        gemv.one_row_ahead(kind, on)
        return pass_seconds(runs, None)

    best = best_of_rounds({True: True, False: False}, seconds)
    ahead = own if best[own] <= MARGIN * best[not own] else not own
    gemv.one_row_ahead(kind, ahead)
    return ahead
