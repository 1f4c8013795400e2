"""The model's forward pass: cached decoding, attention variants and RoPE invariants."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import assert_close, forward_roundings

from astrai import ModelConfig, forward, forward_cached, init_cache, init_params
from astrai.model import apply_rope, rope_tables

VOCAB = 97


@st.composite
def small_configs(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    attn = draw(st.sampled_from(["gqa", "mla"]))
    ffn = draw(st.sampled_from(["mlp", "moe"]))
    return ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=48,
        attn_type=attn,
        kv_lora_rank=16,
        q_lora_rank=draw(st.sampled_from([None, 12])),
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        ffn_type=ffn,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_shared_experts=draw(st.integers(0, 1)),
        use_qk_norm=draw(st.booleans()),
        use_gated_attention=draw(st.booleans()),
        attention_bias=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
    )


@settings(max_examples=25, deadline=None)
@given(cfg=small_configs(), seed=st.integers(0, 2**16), prompt_len=st.integers(1, 6))
def test_full_forward_equals_token_by_token_decoding(cfg, seed, prompt_len):
    params = init_params(cfg, seed=seed)
    # Larger weights than the default init make mistakes in the cache visible.
    params = {k: v * 8 if v.dim() == 2 else v for k, v in params.items()}
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(seed))
    full = forward(params, cfg, tokens)
    cache = init_cache(cfg, batch=2, max_len=10)
    logits, cache = forward_cached(params, cfg, tokens[:, :prompt_len], cache, start=0)
    steps = [logits]
    for t in range(prompt_len, 10):
        logits, cache = forward_cached(params, cfg, tokens[:, t : t + 1], cache, start=t)
        steps.append(logits)
    # The weights scaled by 8 amplify each layer's rounding by up to 8 in the next one.
    assert_close(torch.cat(steps, dim=1), full, 8 * forward_roundings(cfg, 10))


def test_gqa_with_all_heads_equals_plain_multi_head_attention():
    cfg = ModelConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=48,
    )  # fmt: skip
    params = init_params(cfg, seed=1)
    x = torch.randn(2, 7, 32)
    p = "model.layers.0.self_attn"
    q = (x @ params[f"{p}.q_proj.weight"].T).view(2, 7, 4, 8)
    k = (x @ params[f"{p}.k_proj.weight"].T).view(2, 7, 4, 8)
    v = (x @ params[f"{p}.v_proj.weight"].T).view(2, 7, 4, 8)
    positions = torch.arange(7).expand(2, 7)
    cos, sin = rope_tables(cfg, positions)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / 8**0.5
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    reference = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(2, 7, 32)
    reference = reference @ params[f"{p}.o_proj.weight"].T

    from astrai.model.attention import attention_layer, identity_store

    ours = attention_layer(params, cfg, 0, x, (cos, sin), identity_store, None, True)
    # q/k/v and o projections sum over 32, the scores over a head's 8, the mix over 7 positions
    assert_close(ours, reference, 2 * 32 + 8 + 7)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(0, 500), n=st.integers(0, 500), shift=st.integers(0, 1000))
def test_rope_scores_depend_only_on_relative_position(m, n, shift):
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=8)
    gen = torch.Generator().manual_seed(m * 1000 + n)
    q, k = torch.randn(1, 1, 1, 16, generator=gen), torch.randn(1, 1, 1, 16, generator=gen)

    def score(i, j):
        cq, sq = rope_tables(cfg, torch.tensor([[i]]))
        ck, sk = rope_tables(cfg, torch.tensor([[j]]))
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    # An angle position * frequency rounds by about position * eps (frequencies are <= 1), and
    # the score sums 16 products of such rotated values.
    assert_close(score(m, n), score(m + shift, n + shift), 16 * (max(m, n) + shift + 1))


def test_rope_preserves_norm_and_position_zero_is_identity():
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=8)
    x = torch.randn(1, 5, 4, 16)
    cos, sin = rope_tables(cfg, torch.arange(5)[None])
    rotated = apply_rope(x, cos, sin)
    assert_close(rotated.norm(dim=-1), x.norm(dim=-1), 16 + 4)  # 16 squares; 2 products each
    assert torch.equal(rotated[:, 0], x[:, 0])  # cos 0 = 1 and sin 0 = 0 are exact


def test_document_mask_isolates_packed_documents():
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=48)  # fmt: skip
    params = init_params(cfg, seed=3)
    a, b = torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 4))
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 5 + [1] * 4])
    positions = torch.tensor([list(range(5)) + list(range(4))])
    logits = forward(params, cfg, packed, positions=positions, doc_ids=doc_ids)
    assert_close(logits[:, :5], forward(params, cfg, a), forward_roundings(cfg, 9))
    assert_close(logits[:, 5:], forward(params, cfg, b), forward_roundings(cfg, 9))


def test_moe_aux_loss_is_returned_and_differentiable():
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=48, ffn_type="moe", n_routed_experts=4,
                      moe_intermediate_size=16)  # fmt: skip
    params = init_params(cfg, seed=4)
    tokens = torch.randint(0, VOCAB, (2, 8))

    def aux_of(p):
        return forward(p, cfg, tokens, return_aux=True)[1]

    grads = torch.func.grad(aux_of)(params)
    assert aux_of(params) > 0
    assert grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0
