"""Sliding-window attention: a layer with a window of W sees its own position and the W - 1
before it, in training, the contiguous cache and the page pool alike."""

import pytest
import torch
from numerics import assert_close, forward_roundings

from astrai import (
    ModelConfig,
    decode_step,
    forward,
    forward_cached,
    init_cache,
    init_pages,
    init_params,
    prefill,
)
from astrai.infer import alloc_pages

VOCAB = 61
WINDOW = 4
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, initializer_range=0.2)  # fmt: skip
MIXED = ModelConfig(
    **BASE,
    sliding_window=WINDOW,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
)


def tokens_of(length: int, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_a_window_of_one_sees_only_its_own_token():
    # Every layer attends to its own position only: each token's logits are those of the token
    # alone, wherever it stands (RoPE rotates a query and its one key alike).
    cfg = ModelConfig(**BASE, sliding_window=1)
    params = init_params(cfg, seed=1)
    tokens = tokens_of(12)
    logits = forward(params, cfg, tokens)
    alone = forward(params, cfg, tokens.reshape(-1, 1)).reshape(logits.shape)
    assert_close(logits, alone, forward_roundings(cfg, 12))


def test_a_window_reaching_back_to_the_start_changes_nothing():
    params = init_params(MIXED, seed=2)
    plain = ModelConfig(**BASE)
    tokens = tokens_of(WINDOW)
    assert_close(
        forward(params, MIXED, tokens),
        forward(params, plain, tokens),
        forward_roundings(plain, WINDOW),
    )


def test_the_window_is_honoured_past_its_end():
    # Past W tokens the sliding layers forget the start: changing the first token changes the
    # logits of a model without windows at the last position, and not those of a model whose
    # every layer slides (after W positions per layer, 3 layers: 3 * (W - 1) + 1 tokens back).
    cfg = ModelConfig(**BASE, sliding_window=WINDOW)
    params = init_params(cfg, seed=3)
    reach = cfg.num_hidden_layers * (WINDOW - 1)
    tokens = tokens_of(reach + 2)
    changed = tokens.clone()
    changed[:, 0] = (changed[:, 0] + 1) % VOCAB
    last = forward(params, cfg, tokens)[:, -1]
    assert torch.equal(last, forward(params, cfg, changed)[:, -1])
    plain = ModelConfig(**BASE)
    assert not torch.equal(
        forward(params, plain, tokens)[:, -1], forward(params, plain, changed)[:, -1]
    )


def test_packed_documents_keep_their_windows():
    params = init_params(MIXED, seed=4)
    a, b = tokens_of(7, seed=5, batch=1), tokens_of(9, seed=6, batch=1)
    doc_ids = torch.tensor([[0] * 7 + [1] * 9])
    positions = torch.tensor([list(range(7)) + list(range(9))])
    packed = forward(params, MIXED, torch.cat([a, b], 1), positions=positions, doc_ids=doc_ids)
    tol = forward_roundings(MIXED, 16)
    assert_close(packed[:, :7], forward(params, MIXED, a), tol)
    assert_close(packed[:, 7:], forward(params, MIXED, b), tol)


def test_the_contiguous_cache_equals_the_full_pass_over_three_windows():
    params = init_params(MIXED, seed=7)
    tokens = tokens_of(3 * WINDOW + 2, seed=8)
    full = forward(params, MIXED, tokens)
    cache = init_cache(MIXED, batch=2, max_len=tokens.shape[1])
    logits, cache = forward_cached(params, MIXED, tokens[:, :5], cache, start=0)
    steps = [logits]
    for t in range(5, tokens.shape[1]):
        logits, cache = forward_cached(params, MIXED, tokens[:, t : t + 1], cache, start=t)
        steps.append(logits)
    assert_close(torch.cat(steps, 1), full, forward_roundings(MIXED, tokens.shape[1]))


@pytest.mark.parametrize("chunks", [[3, 5, 6], [14]])
def test_paged_chunks_and_decode_equal_the_full_pass_over_three_windows(chunks):
    params = init_params(MIXED, seed=9)
    length = 3 * WINDOW + 6
    tokens = tokens_of(length, seed=10)
    full = forward(params, MIXED, tokens)
    page_size = 3  # windows and pages cut the sequence at different places
    pool = init_pages(MIXED, 16, page_size)
    pool, pages = alloc_pages(pool, 14)
    order = torch.randperm(14, generator=torch.Generator().manual_seed(0))
    table = torch.tensor(pages)[order].view(2, 7)
    tol = forward_roundings(MIXED, length)
    with torch.no_grad():
        start = 0
        for n in chunks:
            logits, pool = prefill(params, MIXED, pool, tokens[:, start : start + n], table, start)
            start += n
            assert_close(logits, full[:, start - 1], tol)
        for t in range(start, length):
            positions = torch.tensor([t, t])
            logits, pool = decode_step(params, MIXED, pool, tokens[:, t], positions, table)
            assert_close(logits, full[:, t], tol)


def test_stored_keys_without_the_window_mask_are_refused():
    from astrai.model import decode_layers, embed

    params = init_params(MIXED)
    tokens = tokens_of(5)
    mask = torch.ones(1, 1, 5, 9, dtype=torch.bool)  # 5 new tokens over 9 stored keys
    with pytest.raises(ValueError, match="sliding="):
        decode_layers(params, MIXED, embed(params, MIXED, tokens), torch.arange(5)[None], mask)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sliding_window": 0}, "sliding_window must be positive"),
        ({"layer_types": ("full_attention",) * 3}, None),
        ({"layer_types": ("sliding_attention",) * 3}, "set sliding_window"),
        ({"sliding_window": 4, "layer_types": ("full_attention",)}, "num_hidden_layers = 3"),
        ({"sliding_window": 4, "model_type": "encoder"}, "causal decoders"),
    ],
)
def test_window_settings_are_checked(settings, message):
    if message is None:
        assert not ModelConfig(**BASE, **settings).has_sliding_layers
        return
    with pytest.raises(ValueError, match=message):
        ModelConfig(**BASE, **settings)
