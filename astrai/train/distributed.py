"""Data parallelism through torch.distributed: every rank holds the whole model, reads its own
slice of each global batch, and the gradients are summed across ranks before the update.

`torchrun` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; without them the
run is a single process and every function here is a no-op.
"""

from __future__ import annotations

import datetime
import os
from typing import NamedTuple

import torch
import torch.distributed as dist


class DistInfo(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(device: str, local_rank: int = 0) -> torch.device:
    if device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.is_available():
        return torch.device(f"cuda:{local_rank}")
    return torch.device(device)


def init_distributed(backend: str = "auto", device: str = "auto") -> DistInfo:
    """Join the process group torchrun describes (once), or describe a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return DistInfo(rank, world_size, local_rank, dev)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum_(tensors: list[torch.Tensor], bucket_mb: float = 25.0) -> None:
    """Sum `tensors` over all ranks, in place.

    Tensors are flattened into buckets of about bucket_mb and each bucket is one all_reduce:
    a few large messages instead of one per parameter, which is what the interconnect likes.
    """
    if world_size() == 1 or not tensors:
        return
    limit = int(bucket_mb * 2**20)
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (size + t.numel() * t.element_size() > limit or t.dtype != bucket[0].dtype):
            _reduce_bucket(bucket)
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    _reduce_bucket(bucket)


def _reduce_bucket(bucket: list[torch.Tensor]) -> None:
    flat = torch.cat([t.reshape(-1) for t in bucket])
    dist.all_reduce(flat)
    pieces = flat.split([t.numel() for t in bucket])
    torch._foreach_copy_(bucket, [p.view_as(t) for p, t in zip(pieces, bucket)])


def broadcast_(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrite every rank's tensors with rank `src`'s, so all ranks start identical."""
    if world_size() == 1:
        return
    for t in tensors:
        dist.broadcast(t, src)


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
