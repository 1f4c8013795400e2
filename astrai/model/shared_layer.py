"""One compiled decoder layer serving every layer of a model (regional compilation, as
torchtitan compiles each transformer block once instead of the whole unrolled model).

torch.compile guards a graph on what its function reads: the names of the weights, their shapes
and the layer index. Layer i's weights (and LoRA adapters) handed over under the names of the
first layer built like it therefore pass the guards of that layer's graph, which is traced and
compiled once and then reused: a model whose layers are all alike compiles one layer's forward
and backward, however deep it is. Layers built differently (a dense layer beside MoE layers, a
sliding-window layer, one without RoPE) each get their own graph, as they must.
"""

from __future__ import annotations

from astrai.config import ModelConfig


def layer_kind(cfg: ModelConfig, i: int) -> tuple[bool, bool, bool]:
    """What makes layers compile differently: (MoE, sliding window, without RoPE)."""
    return cfg.is_moe_layer(i), cfg.is_sliding_layer(i), i in cfg.nope_layers


def representative(cfg: ModelConfig, i: int) -> int:
    """The first layer built like layer i: its compiled graph runs layer i."""
    kind = layer_kind(cfg, i)
    return next(j for j in range(i + 1) if layer_kind(cfg, j) == kind)


def renamed(tree: dict, i: int, j: int) -> dict:
    """The entries of layer i ("model.layers.{i}.*") under layer j's names; others dropped."""
    mine, theirs = f"model.layers.{i}.", f"model.layers.{j}."
    return {theirs + k[len(mine) :]: v for k, v in tree.items() if k.startswith(mine)}


def run_shared(compiled, params: dict, cfg: ModelConfig, i: int, *rest, lora: dict | None):
    """Layer i through `compiled` (astrai.model.forward.compile_layer()) as the first layer
    built like it; `rest` are the layer's other arguments (x, rope, kv_store, mask, causal)."""
    j = representative(cfg, i)
    if lora is not None:
        if "weights" not in lora:
            raise ValueError(
                "a compiled layer takes one adapter ({'scale', 'weights'}), not a stack"
            )
        lora = {"scale": lora["scale"], "weights": renamed(lora["weights"], i, j)}
    return compiled(renamed(params, i, j), cfg, j, *rest, lora)
