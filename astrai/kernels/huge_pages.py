"""Weights and K/V pages in memory backed by 2 MiB pages.

A decode step streams every weight once, and at one row it runs at the memory's speed. Read
through 4 KiB pages, a stream crosses a page every 64 cache lines, each a translation to look
up and a boundary the hardware's prefetchers stop at; through 2 MiB pages, one every 32,768.
Under the "madvise" setting of /sys/kernel/mm/transparent_hugepage/enabled (the one seen on
the machines here) Linux backs anonymous memory with 2 MiB pages only where asked (madvise
MADV_HUGEPAGE), and neither torch's allocator nor glibc's malloc asks. On a 2-core AMD Zen 4, a
1 GiB float32 sum read 32-33 GB/s in such pages against 28-29 in 4 KiB ones, and a 0.5B float32
decode step with its panels in them ran 1.01-1.44x as fast (docs/inference.md, "Weights in
2 MiB pages").
"""

from __future__ import annotations

import contextlib
import mmap

import torch

PAGE = 2 << 20


def zeros_in_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """A tensor of zeros whose memory the kernel is asked to back with 2 MiB pages (its whole
    2 MiB stretches: the tail under one stays in 4 KiB pages, so no page is held that the
    tensor does not fill), a mapping of its own, returned when the tensor is freed; where it
    holds less than 2 MiB, is not on the CPU, or the system has no such advice (off Linux),
    torch.zeros'."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    cpu = torch.device(device).type == "cpu"
    if not cpu or nbytes < PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # anonymous memory reads as zeros until written: nothing to fill
    region = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the region mapped while it lives
    start = -raw.data_ptr() % PAGE
    with contextlib.suppress(OSError):  # a kernel without them: 4 KiB pages, as malloc's
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // PAGE * PAGE)
    return raw[start : start + nbytes].view(dtype).view(shape)


def contiguous_in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """t's values in a new contiguous tensor in memory advised to 2 MiB pages
    (zeros_in_huge_pages); t.contiguous() where t holds less than 2 MiB or is not on the CPU."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < PAGE:
        return t.contiguous()
    return zeros_in_huge_pages(t.shape, t.dtype).copy_(t)
