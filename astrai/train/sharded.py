"""Sharded training (ZeRO-3 / FSDP semantics) on DTensor: each rank keeps 1/N of every weight,
gradient and optimizer moment, and a weight is gathered whole only while the model reads it.

The params stay a flat dict, now of DTensors sharded along dim 0 over a device mesh
(`shard_params`): one dimension of shards, or with `replicas` > 1 (hybrid sharding, HSDP) a
second dimension across which each shard is replicated. `gathered(params)` is a read-only
mapping the pure `forward` takes in place of the dict: reading a key all-gathers that tensor
(`redistribute` to `Replicate`), and its gradient flows back as a `Partial` sum that DTensor's
autograd reduce-scatters onto the shard. This is torchtitan's SimpleFSDP: the collectives are
DTensor's, the model code is ours.

Layers run under activation checkpointing in this mode, so a layer's gathered weights are
dropped when its forward ends and gathered again when its backward recomputes it: at any
moment one layer is whole (plus the embedding and head, read outside the layers).

The optimizer updates the local shards (`local`), and a sharded state is checkpointed by every
rank at once through torch.distributed.checkpoint (astrai/train/sharded_checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cache

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_map


@cache
def _mesh(device_type: str, replicas: int, shards: int) -> DeviceMesh:
    if replicas == 1:
        return init_device_mesh(device_type, (shards,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicas, shards), mesh_dim_names=("replicate", "shard"))


def mesh_for(device: torch.device, replicas: int = 1) -> DeviceMesh:
    """The mesh over every rank of the process group, on `device`'s type: one dimension of
    shards, or `replicas` groups of consecutive ranks (hybrid sharding: each group holds a
    whole copy of the state, sharded over its ranks)."""
    world = torch.distributed.get_world_size()
    if replicas < 1 or world % replicas:
        raise ValueError(f"parallel.replicas = {replicas} does not divide the {world} ranks")
    return _mesh(device.type, replicas, world // replicas)


def placements(mesh: DeviceMesh) -> list:
    """Dim 0 split over the mesh's last dimension, a whole copy along a replica dimension."""
    return [Replicate()] * (mesh.ndim - 1) + [Shard(0)]


def shard_params(params: dict[str, torch.Tensor], mesh: DeviceMesh) -> dict[str, DTensor]:
    """Whole tensors -> DTensors sharded along dim 0, each rank's piece scattered from rank 0's
    tensor (so all ranks start from the same weights)."""
    return {k: distribute_tensor(v, mesh, placements(mesh)) for k, v in params.items()}


def replicas_of(tree: dict) -> int:
    """How many whole copies of a sharded state the ranks hold (1 unless hybrid)."""
    mesh = next(iter(tree.values())).device_mesh
    return mesh.size(0) if mesh.ndim > 1 else 1


def is_sharded(tree) -> bool:
    """Whether a params dict holds DTensors (a sharded state) rather than whole tensors."""
    return isinstance(tree, dict) and isinstance(next(iter(tree.values()), None), DTensor)


def local(tree):
    """The same pytree (nested dicts, an optimizer state) with every DTensor replaced by this
    rank's shard, which shares its storage: updating the shard in place updates the DTensor."""
    return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, tree)


def gather(shard: DTensor) -> torch.Tensor:
    """The whole tensor on every rank; its gradient is summed over ranks and scattered back to
    the shards (the gradient on each rank is only that rank's part of the batch: `Partial`)."""
    mesh = shard.device_mesh
    whole = shard.redistribute(mesh, [Replicate()] * mesh.ndim)
    # backward: summed within each replica group (reduce-scatter) and across groups
    # (all-reduce), so every copy of a shard gets the same gradient
    return whole.to_local(grad_placements=[Partial()] * mesh.ndim)


class gathered(Mapping):
    """A read-only view of sharded params as whole tensors, gathered on each read."""

    def __init__(self, shards: Mapping[str, DTensor]):
        self._shards = shards

    def __getitem__(self, key: str) -> torch.Tensor:
        return gather(self._shards[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._shards)

    def __len__(self) -> int:
        return len(self._shards)

    def __contains__(self, key) -> bool:
        return key in self._shards


def full_params(params: dict[str, DTensor]) -> dict[str, torch.Tensor]:
    """Whole tensors on every rank (a collective: all ranks must call it), for export."""
    return {k: v.full_tensor() for k, v in params.items()}


def local_bytes(tree) -> int:
    """Bytes of this rank's tensors in a (possibly sharded) nested dict."""
    if isinstance(tree, dict):
        return sum(local_bytes(v) for v in tree.values())
    if isinstance(tree, torch.Tensor):
        t = local(tree)
        return t.numel() * t.element_size()
    return 0
