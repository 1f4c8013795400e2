"""LoRA as a separate pytree, and the embedding encoder."""

import pytest
import torch
from numerics import assert_close, forward_roundings

from astrai import ModelConfig, encode, forward, init_lora, init_params, merge_lora

CFG = ModelConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=48)  # fmt: skip


def test_lora_with_zero_b_equals_the_base_model():
    params = init_params(CFG, seed=0)
    lora = init_lora(params, CFG, rank=4, alpha=8)
    tokens = torch.randint(0, 50, (2, 6))
    # the adapters add x @ A @ B = exact zeros to outputs of the same kernels
    assert torch.equal(forward(params, CFG, tokens, lora=lora), forward(params, CFG, tokens))


def test_merged_lora_equals_unmerged():
    params = init_params(CFG, seed=0)
    lora = init_lora(params, CFG, rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    for pair in lora["weights"].values():
        pair["B"] = torch.randn_like(pair["B"]) * 0.1
    tokens = torch.randint(0, 50, (2, 6))
    unmerged = forward(params, CFG, tokens, lora=lora)
    assert not torch.allclose(unmerged, forward(params, CFG, tokens))
    merged = forward(merge_lora(params, lora), CFG, tokens)
    # merging sums W + s * B @ A (rank 4) before the products instead of after them
    assert_close(merged, unmerged, forward_roundings(CFG, 6) + 4)


def test_lora_rejects_targets_that_match_nothing():
    with pytest.raises(ValueError, match="LoRA targets"):
        init_lora(init_params(CFG), CFG, targets=("nonexistent",))


ENCODER = ModelConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=48, model_type="encoder")  # fmt: skip


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_encoder_embeddings_ignore_padding_and_are_normalised(pooling):
    params = init_params(ENCODER, seed=1)
    short = torch.randint(1, 50, (1, 4))
    padded = torch.cat([short, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0]])
    a = encode(params, ENCODER, short, pooling=pooling)
    b = encode(params, ENCODER, padded, mask, pooling=pooling)
    assert_close(a, b, forward_roundings(ENCODER, 7))  # padding changes attention's sums
    assert_close(a.norm(dim=-1), torch.ones(1), 2 * 32)  # normalised and re-measured over 32


def test_encoder_attends_both_ways():
    params = init_params(ENCODER, seed=2)
    tokens = torch.randint(1, 50, (1, 5))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 50
    first = encode(params, ENCODER, tokens, pooling="cls")
    # Changing the last token moves the first token's state only if attention is bidirectional.
    assert not torch.allclose(first, encode(params, ENCODER, changed, pooling="cls"))
