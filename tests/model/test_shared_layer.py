"""One compiled decoder layer for every layer: the same logits and gradients as the plain
layers, one graph for layers built alike, and each layer's own weights."""

import pytest
import torch
from numerics import assert_close, gradient_roundings

from astrai import ModelConfig, forward, init_params
from astrai.model.forward import compile_layer
from astrai.model.shared_layer import renamed, representative
from astrai.train.compiling import compiler_missing

# Layer 1 has no RoPE: a layer built differently, which must get its own graph.
CFG = ModelConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, intermediate_size=48, max_position_embeddings=32, nope_layers=(1,),
)  # fmt: skip


def test_each_layer_runs_as_the_first_layer_built_like_it():
    assert [representative(CFG, i) for i in range(4)] == [0, 1, 0, 0]
    params = init_params(CFG, seed=0)
    third = renamed(params, 2, 0)
    assert set(third) == {k for k in params if k.startswith("model.layers.0.")}
    assert third["model.layers.0.mlp.up_proj.weight"] is params["model.layers.2.mlp.up_proj.weight"]


@pytest.mark.skipif(compiler_missing(torch.device("cpu")) is not None, reason="no C++ compiler")
def test_compiled_layers_give_the_plain_layers_loss_and_gradients(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    params = init_params(CFG, seed=0)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    layer, graphs_before = compile_layer(), counters["stats"]["unique_graphs"]

    def loss_and_grads(compiled_layer):
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        logits = forward(leaves, CFG, tokens, compiled_layer=compiled_layer)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        return loss, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    loss, grads = loss_and_grads(layer)
    plain_loss, plain_grads = loss_and_grads(None)
    # two graphs: the layers with RoPE (0, 2, 3) share one, the layer without it has its own
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
    # inductor's fused kernels round differently from eager's: one gradient's worth of roundings
    roundings = gradient_roundings(CFG, 16, tokens.numel())
    assert_close(loss, plain_loss, roundings)
    for key, grad in plain_grads.items():  # every layer's gradient lands on its own weights
        assert_close(grads[key], grad, roundings)
