"""Run under torchrun: one sharded AdamW step of a tiny model, measuring what each rank holds.

Appends one JSON line per rank to the file given (a second argument sets parallel.replicas):
the bytes of this rank's params, gradients and optimizer moments, the whole (unsharded) total,
and the most gathered weight bytes alive at once during the step (every gather is counted until
the tensor is freed).
"""

from __future__ import annotations

import json
import sys
import weakref

import msgspec
import torch
import torch.distributed as dist

from astrai.config import ModelConfig, train_config
from astrai.model import init_params
from astrai.train import sharded, step
from astrai.train.distributed import init_distributed
from astrai.train.state import init_train_state

MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    tie_word_embeddings=False,
)


class GatherMeter:
    """Counts the bytes of gathered tensors alive, and the peak."""

    def __init__(self, gather):
        self.gather, self.alive, self.peak = gather, 0, 0

    def __call__(self, shard):
        whole = self.gather(shard)
        size = whole.numel() * whole.element_size()
        self.alive += size
        self.peak = max(self.peak, self.alive)
        weakref.finalize(whole, self.release, size)
        return whole

    def release(self, size: int) -> None:
        self.alive -= size


def main(out: str, replicas: int) -> None:
    info = init_distributed("gloo", "cpu")
    model = msgspec.to_builtins(MODEL)
    parallel = {"mode": "sharded", "replicas": replicas}
    cfg = train_config({"model": model, "batch_size": 4, "parallel": parallel})
    whole = init_params(MODEL, seed=0)
    sizes = {k: v.numel() * v.element_size() for k, v in whole.items()}
    rows = {k: v[0].numel() * v.element_size() if v.dim() else 0 for k, v in whole.items()}
    params = sharded.shard_params(whole, sharded.mesh_for(info.device, replicas))
    state = init_train_state(params, cfg, MODEL)

    meter = GatherMeter(sharded.gather)
    sharded.gather = meter
    grad_bytes = []
    accumulate = step._accumulate

    def measured(*args):
        grads, *rest = accumulate(*args)
        grad_bytes.append(sum(g.numel() * g.element_size() for g in grads))
        return (grads, *rest)

    step._accumulate = measured
    tokens = torch.randint(0, MODEL.vocab_size, (4 // info.world_size, 16))
    batch = {"input_ids": tokens, "labels": tokens}
    state, _ = step.train_step(state, batch)

    moments = sharded.local_bytes(state.opt.m) + sharded.local_bytes(state.opt.v)
    layers = [
        sum(s for k, s in sizes.items() if k.startswith(f"model.layers.{i}."))
        for i in range(MODEL.num_hidden_layers)
    ]
    report = {
        "rank": info.rank,
        "whole_bytes": 4 * sum(sizes.values()),  # params, gradients, two AdamW moments
        "held_bytes": sharded.local_bytes(state.params) + grad_bytes[0] + moments,
        "slack_bytes": 4 * sum(rows.values()),
        "layer_bytes": max(layers),
        "largest_tensor_bytes": max(sizes.values()),
        "outside_layers_bytes": sum(sizes.values()) - sum(layers),
        "peak_gathered_bytes": meter.peak,
    }
    for rank in range(info.world_size):  # one writer at a time
        if rank == info.rank:
            with open(out, "a") as f:
                f.write(json.dumps(report) + "\n")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
