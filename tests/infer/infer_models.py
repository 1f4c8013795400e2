"""Tiny models for the inference tests, and a reference greedy decoder."""

from __future__ import annotations

import torch

import astrai as ai

# A larger init than training uses makes greedy choices decisive, so float32 equivalence tests
# compare tokens without near-ties.
BASE = dict(
    vocab_size=300,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=256,
    initializer_range=0.3,
)

CONFIGS = {
    "gqa": ai.ModelConfig(**BASE),
    "gqa_variants": ai.ModelConfig(
        **BASE, use_qk_norm=True, use_gated_attention=True, attention_bias=True
    ),
    "mla": ai.ModelConfig(
        **BASE,
        attn_type="mla",
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
    ),
    "moe": ai.ModelConfig(
        **BASE,
        ffn_type="moe",
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
}


def make_model(kind: str = "gqa", seed: int = 0):
    cfg = CONFIGS[kind]
    params = ai.init_params(cfg, seed=seed)
    if cfg.attention_bias:  # non-zero biases, so a missing bias would show
        g = torch.Generator().manual_seed(seed)
        for key in [k for k in params if k.endswith(".bias")]:
            params[key] = torch.randn(params[key].shape, generator=g) * 0.3
    return params, cfg


def greedy_reference(params, cfg, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens by full recomputation with `forward` (no cache at all)."""
    tokens = list(prompt)
    for _ in range(n):
        logits = ai.forward(params, cfg, torch.tensor([tokens]))
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@torch.inference_mode()
def greedy_loop(params, cfg, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens by a paged prefill of the prompt and one decode step a token (page size
    4, room for 32 tokens)."""
    pool, pages = ai.alloc_pages(ai.init_pages(cfg, 8, 4, torch.float32), 8)
    table = torch.tensor([pages])
    logits, pool = ai.prefill(params, cfg, pool, torch.tensor([prompt]), table, 0)
    tokens = [int(logits.argmax(-1))]
    for position in range(len(prompt), len(prompt) + n - 1):
        token, at = torch.tensor(tokens[-1:]), torch.tensor([position])
        logits, pool = ai.decode_step(params, cfg, pool, token, at, table)
        tokens.append(int(logits.argmax(-1)))
    return tokens


def every_int8(kernel: str, split: tuple[int, str] | None = None):
    """A stand-in for prepare.int8_products that gives every matrix `kernel` (and `split`)
    without timing any."""
    return lambda matrices, copies: {w.shape: (kernel, split) for w in matrices.values()}
