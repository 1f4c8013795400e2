"""8-bit weights: each product against the float one, the Engine against recomputation with
the same weights, and the quality of a trained model (perplexity on held-out text)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from infer_models import greedy_reference, make_model

import astrai as ai
from astrai.infer import Engine, Int8Matrix, kernels_used, prepare, prepare_params
from astrai.infer.prepare import fuse_projections
from astrai.infer.quant import BUILDERS, int8_matrix, quantize_rows

# bf16 keeps 8 significant bits; 8-bit activations (fbgemm's dynamic product) keep 7 or 8
BF16_EPS = torch.finfo(torch.bfloat16).eps
INT8_STEP = 1 / 63  # a 7-bit activation's step relative to its largest value


def runnable(kernel: str) -> bool:
    try:
        int8_matrix(torch.randn(8, 16), kernel).linear(torch.randn(1, 16))
        return True
    except RuntimeError:
        return False


def test_rows_round_to_the_nearest_step():
    w = torch.randn(64, 96)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5)).all())
    assert bool((q.abs().amax(1) == 127).all())  # each row uses its whole range


@pytest.mark.parametrize("kernel", list(BUILDERS))
@pytest.mark.parametrize("rows", [1, 5])
def test_each_product_is_the_product_of_the_dequantized_matrix(kernel, rows):
    if not runnable(kernel):
        pytest.skip(f"{kernel} does not run on this machine")
    torch.manual_seed(0)
    m = int8_matrix(torch.randn(48, 80), kernel)
    x = torch.randn(rows, 3, 80)
    expected = x @ m.dequantize().T
    y = m.linear(x)
    assert y.shape == (rows, 3, 48) and y.dtype == x.dtype
    # error of the activations' rounding, summed over 80 terms, relative to the output's scale
    step = BF16_EPS if kernel == "weight_only" else INT8_STEP
    tol = 4 * step * x.abs().max() * m.dequantize().abs().sum(1).max()
    assert float((y - expected).abs().max()) <= float(tol)


def test_prepare_quantizes_the_matrices_but_not_the_embedding_or_norms():
    params, _ = make_model("gqa")
    prepared = prepare_params(params, quantize="int8")
    assert isinstance(prepared["lm_head.weight"], Int8Matrix)  # tied: a copy of its own
    assert isinstance(prepared["model.layers.0.self_attn.qkv_proj.weight"], Int8Matrix)
    assert prepared["model.embed_tokens.weight"] is params["model.embed_tokens.weight"]
    assert prepared["model.norm.weight"] is params["model.norm.weight"]
    # per layer: q, k and v fused, o, gate and up fused, down
    assert sum(kernels_used(prepared).values()) == 2 * 4 + 1
    with pytest.raises(ValueError, match="quantize"):
        prepare_params(params, quantize="int4")


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_engine_matches_recomputation_with_the_same_8_bit_weights(kind, monkeypatch):
    # One product on both sides, whichever measures faster here: the weight-only one, since
    # fbgemm's dynamic product scales the activations per call, so its rows depend on what
    # else is in the batch (a whole prompt here, one token per row in the engine's decode).
    monkeypatch.setattr(prepare, "fastest_kernel", lambda *shape: "weight_only")
    params, cfg = make_model(kind)
    reference = prepare_params(params, quantize="int8")
    prompts = [[5, 17, 42, 8], [100, 3, 250, 77, 9, 11]]
    with Engine(params, cfg, None, quantize="int8", max_batch=4, page_size=4) as engine:
        outs = engine.generate(prompts, max_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(reference, cfg, prompt, 12)


CHOICE = torch.tensor([0.7, 0.1, 0.1, 0.1])


def markov_text(rows: int, length: int, seed: int, vocab: int = 64) -> torch.Tensor:
    """Token rows from a fixed random Markov chain in which each token has four successors, one
    of them likely (0.7): the best greedy choice is clear, not a tie."""
    table = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, length, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    for t in range(1, length):
        pick = torch.multinomial(CHOICE.expand(rows, 4), 1, generator=g)[:, 0]
        out[:, t] = table[out[:, t - 1], pick]
    return out


def perplexity(params, cfg, tokens: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = ai.forward(params, cfg, tokens[:, :-1])
        return float(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).exp())


@pytest.fixture(scope="module")
def trained():
    """A small model trained on the Markov chain for 150 steps (a few seconds on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small products on a busy machine: more threads only contend
    try:
        torch.manual_seed(0)
        cfg = ai.ModelConfig(
            vocab_size=64,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
        )
        params = {k: v.clone().requires_grad_() for k, v in ai.init_params(cfg, seed=0).items()}
        opt = torch.optim.Adam(params.values(), lr=3e-3)
        for step in range(150):
            batch = markov_text(16, 33, seed=1 + step)
            logits = ai.forward(params, cfg, batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        return {k: v.detach() for k, v in params.items()}, cfg
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", [None, *BUILDERS])  # None: the one measured fastest here
def test_a_trained_model_keeps_its_perplexity_and_greedy_choices_in_8_bits(trained, kernel):
    if kernel is not None and not runnable(kernel):
        pytest.skip(f"{kernel} does not run on this machine")
    params, cfg = trained
    held_out = markov_text(32, 33, seed=10_000)
    full = perplexity(params, cfg, held_out)
    assert full < 6  # it learnt the chain (2.6 at best, 64 knowing nothing)
    int8 = prepare_params(params, quantize="int8")
    if kernel is not None:  # the same 8-bit matrices, run by the kernel under test
        source = fuse_projections(params)
        int8 = {
            k: int8_matrix(source.get(k, params["model.embed_tokens.weight"]), kernel)
            if isinstance(w, Int8Matrix)
            else w
            for k, w in int8.items()
        }
    assert abs(perplexity(int8, cfg, held_out) - full) / full < 0.01
    with torch.inference_mode():
        a = ai.forward(params, cfg, held_out).argmax(-1)
        b = ai.forward(int8, cfg, held_out).argmax(-1)
    assert float((a == b).float().mean()) >= 0.98
