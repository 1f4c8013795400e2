"""Each Hugging Face family against transformers itself: a small model of the family with random
weights, written by transformers' save_pretrained (no download), read by load_pretrained.

For every family: the logits of `forward`; paged prefill in chunks and decode_step over three
windows (sliding layers tested past their window); greedy generation through the Engine
(chunked prefill, paging, batching, prepared weights); the folder our save_pretrained writes,
read back by transformers; and the logits in bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close, forward_roundings, tolerance

from astrai import Engine, decode_step, forward, init_pages, load_pretrained, prefill
from astrai import save_pretrained as save_ours
from astrai.infer import alloc_pages

transformers = pytest.importorskip("transformers")

WINDOW = 5
LENGTH = 3 * WINDOW + 3  # every sliding layer is tested well past its window
SHAPE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
}

# family: (config class, model class, the settings that exercise what sets it apart)
FAMILIES = {
    "llama": (  # Llama 3.2: llama3 RoPE scaling, tied embeddings
        "LlamaConfig", "LlamaForCausalLM",
        dict(tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        }),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen2": (  # windows from max_window_layers on, q/k/v biases
        "Qwen2Config", "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "qwen3": (
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, layer_types=MIXED),
    ),
    "qwen3_moe": (  # routed experts only, a dense layer between the sparse ones
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    ),
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
             attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    ),
    "gemma3_text": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(head_dim=16, sliding_window=WINDOW, layer_types=MIXED, query_pre_attn_scalar=24,
             final_logit_softcapping=4.0, tie_word_embeddings=False,
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
             }),
    ),
    "phi3": (  # Phi-4-mini: a quarter of each head unrotated, LongRoPE, fused projections
        "Phi3Config", "Phi3ForCausalLM",
        dict(sliding_window=WINDOW, partial_rotary_factor=0.75, max_position_embeddings=256,
             original_max_position_embeddings=64, rope_scaling=LONGROPE),
    ),
    "smollm3": (  # NoPE on every second layer here, and a window on it
        "SmolLM3Config", "SmolLM3ForCausalLM",
        dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=WINDOW,
             attention_bias=True, mlp_bias=True),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(attention_bias=True)),
    "granite": (
        "GraniteConfig", "GraniteForCausalLM",
        dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
             logits_scaling=2.5, mlp_bias=True),
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf(request, tmp_path_factory):
    """(family, the transformers model, its folder): random weights, norms and biases included,
    so that a norm or a bias read wrongly shows."""
    family = request.param
    config_cls, model_cls, settings = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**SHAPE, **settings})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp(family)
    model.save_pretrained(folder)
    return family, model, folder


def tokens_of(batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SHAPE["vocab_size"], (batch, length), generator=g)


def test_the_family_is_read_as_itself(hf):
    family, _, folder = hf
    _, cfg = load_pretrained(folder)
    assert cfg.family == family


def ours_and_theirs(hf, seed: int):
    """(params, cfg) read from the family's folder, two sequences of LENGTH tokens, and
    transformers' logits for them."""
    _, model, folder = hf
    tokens = tokens_of(2, LENGTH, seed)
    with torch.no_grad():
        expected = model(tokens).logits
    return *load_pretrained(folder), tokens, expected


def test_forward_matches_transformers(hf):
    params, cfg, tokens, expected = ours_and_theirs(hf, seed=1)
    assert_close(forward(params, cfg, tokens), expected, forward_roundings(cfg, LENGTH))


def test_paged_prefill_and_decode_match_transformers(hf):
    params, cfg, tokens, expected = ours_and_theirs(hf, seed=2)
    page_size = 4  # pages and windows end at different places
    pool = init_pages(cfg, 12, page_size)
    pool, pages = alloc_pages(pool, 10)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    table = torch.tensor(pages)[order].view(2, 5)
    roundings = forward_roundings(cfg, LENGTH)
    with torch.no_grad():
        start = 0
        for n in (4, WINDOW + 2):  # two prompt chunks, the second reaching past the window
            logits, pool = prefill(params, cfg, pool, tokens[:, start : start + n], table, start)
            start += n
            assert_close(logits, expected[:, start - 1], roundings)
        for t in range(start, LENGTH):
            logits, pool = decode_step(params, cfg, pool, tokens[:, t], torch.tensor([t, t]), table)
            assert_close(logits, expected[:, t], roundings)


def test_greedy_generation_through_the_engine_matches_transformers(hf):
    _, model, folder = hf
    prompts = [tokens_of(1, 7, seed=3), tokens_of(1, 3, seed=4)]
    new = 2 * WINDOW
    with torch.no_grad():
        expected = [
            model.generate(p, max_new_tokens=new, do_sample=False)[0, p.shape[1] :].tolist()
            for p in prompts
        ]
    params, cfg = load_pretrained(folder)
    engine = Engine(params, cfg, None, page_size=4, prefill_chunk=5, dtype="float32")
    try:
        done = engine.generate([p[0].tolist() for p in prompts], max_tokens=new, temperature=0.0)
    finally:
        engine.close()
    assert [c.token_ids for c in done] == expected


def test_the_folder_we_write_is_read_by_transformers(hf, tmp_path):
    _, model, folder = hf
    params, cfg = load_pretrained(folder)
    save_ours(tmp_path, params, cfg)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again) is type(model)
    tokens = tokens_of(2, LENGTH, seed=5)
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, model(tokens).logits)
    assert load_pretrained(tmp_path)[1] == cfg


def test_forward_in_bfloat16_matches_transformers(hf):
    # Both sides round to bfloat16 after each product and norm, at somewhat different places
    # (transformers rounds the RoPE tables, we keep them in float32): a few bfloat16 roundings
    # of the residual stream a layer apart.
    _, model, folder = hf
    params, cfg = load_pretrained(folder, dtype="bfloat16")
    tokens = tokens_of(2, LENGTH, seed=6)
    with torch.no_grad():
        expected = model.to(torch.bfloat16)(tokens).logits.float()
        model.float()
        ours = forward(params, cfg, tokens).float()
    close = tolerance(8 * cfg.num_hidden_layers, torch.bfloat16, expected.abs().max().item())
    torch.testing.assert_close(ours, expected, **close)


def test_longrope_takes_the_long_factors_once_a_sequence_reaches_past_the_original_context(
    tmp_path,
):
    settings = {**SHAPE, **FAMILIES["phi3"][2], "original_max_position_embeddings": 8}
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**settings)).eval()
    model.save_pretrained(tmp_path)
    params, cfg = load_pretrained(tmp_path)
    for length in (8, LENGTH):  # within the original context, and past it
        tokens = tokens_of(1, length, seed=7)
        with torch.no_grad():
            expected = model(tokens).logits
        assert_close(forward(params, cfg, tokens), expected, forward_roundings(cfg, length))
    # batched, each sequence rotates as it would alone: one within, one past the original context
    tokens = tokens_of(2, 6, seed=8)
    positions = torch.stack([torch.arange(6), torch.arange(6) + 10])
    with torch.no_grad():
        alone = [model(tokens[i : i + 1], position_ids=positions[i : i + 1]).logits for i in (0, 1)]
    batched = forward(params, cfg, tokens, positions=positions)
    assert_close(batched, torch.cat(alone), forward_roundings(cfg, 16))
