"""llama.cpp's speculating sides (programs/benchmark/spec_peer.py): prompt lookup and a draft
model must not change llama.cpp's greedy tokens, and their counts must say what was kept."""

from __future__ import annotations

import contextlib

import pytest
from benchmark.spec_peer import SIDES, kept_tokens, llamacpp_side, peer_row

import astrai as ai
from astrai.export import save_gguf

N = 24  # greedy tokens per prompt
K = 4
TINY = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
    # wide weights: logits far apart, so float16 K/V cannot turn a greedy choice
    initializer_range=0.2,
)
# prompts that repeat themselves, so that lookup finds n-grams to continue
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7],
    [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41],
    list(range(100, 130)) + list(range(100, 104)),
]


def test_kept_tokens_counts_leading_matches_within_the_sequence():
    sequence = [1, 2, 3, 4, 5, 6]  # prompt and greedy output
    proposals = [
        (2, [3, 4, 9]),  # two kept, then a miss: the third is not kept
        (4, [7, 6]),  # a miss first: none kept, though 6 is right at its place
        (5, [6, 7, 8]),  # one kept; the last two fall past the end, never checked
    ]
    assert kept_tokens(proposals, sequence) == (3 + 2 + 1, 2 + 0 + 1)
    assert kept_tokens([], sequence) == (0, 0)


class Log:
    def log(self, text: str) -> None:
        pass


def test_peer_row_pairs_rounds_and_leaves_parting_sides_unchecked():
    batches = [[[9]], [[1, 2]], [[3]]]  # round r's requests are batches[r + 1]; [0] warms up
    counts = {"spec_steps": 4, "spec_proposed": 8, "spec_accepted": 4}
    rates = {"spec": [30.0, 50.0, 10.0], "plain": [10.0, 10.0, 10.0]}
    same = {0: [[5, 6, 7]], 1: [[8, 9, 10]]}
    parted = {0: [[5, 6, 7]], 1: [[8, 0, 10]]}  # the second request parts after one token
    outputs = {"spec": same, "plain": parted}
    row = peer_row(
        Log(), "x", ("spec", "plain"), (rates, outputs, {"spec": counts, "plain": {}}), batches
    )
    assert row["ratio"] == 3.0 and row["ratio_range"] == [1.0, 5.0]
    assert "acceptance 0.50, 2.00 tokens/verification" in row["name"]
    assert row["agreement"] == pytest.approx((1 + 1 / 3) / 2)
    assert row["verdict"] == "unchecked"  # llama.cpp's rounding cannot be reproduced here
    outputs["plain"] = same
    row = peer_row(
        Log(), "x", ("spec", "plain"), (rates, outputs, {"spec": counts, "plain": {}}), batches
    )
    assert row["agreement"] == 1.0 and row["verdict"] == "comparable"


def _gguf(folder, seed: int) -> str:
    cfg = ai.ModelConfig(**TINY)
    path = folder / f"model-{seed}.gguf"
    save_gguf(path, ai.init_params(cfg, seed=seed), cfg, None, type="f32", name=path.stem)
    return str(path)


def test_lookup_and_draft_give_llama_cpps_plain_greedy_tokens(tmp_path):
    target, other = _gguf(tmp_path, 0), _gguf(tmp_path, 1)
    # one thread: two spin on a barrier every graph, and on a loaded machine wait seconds there
    base = {"model": target, "k": K, "ngram": 3, "threads": 1, "n_ctx": 128}
    specs = {kind: {**base, "kind": kind, "draft": other} for kind in SIDES}
    # the target as its own draft: every proposal is what the target then chooses
    specs["self-draft"] = {**base, "kind": "draft", "draft": target}
    with contextlib.ExitStack() as stack:
        sides = {name: stack.enter_context(llamacpp_side(spec)) for name, spec in specs.items()}
        tokens = {name: side.generate(PROMPTS, N) for name, side in sides.items()}
        counts = {name: side.counts for name, side in sides.items()}
    assert all(len(out) == N for out in tokens["plain"])
    for name in ("lookup", "draft", "self-draft"):
        assert tokens[name] == tokens["plain"], name
        assert counts[name]["spec_proposed"] > 0, (name, counts[name])
        assert 0 < counts[name]["spec_steps"] < len(PROMPTS) * N, (name, counts[name])
    assert counts["plain"] == {"spec_steps": 0, "spec_proposed": 0, "spec_accepted": 0}
    # another random model's guesses are mostly wrong: the target drops them and goes on
    assert counts["draft"]["spec_accepted"] < counts["draft"]["spec_proposed"]
    own = counts["self-draft"]
    assert own["spec_accepted"] == pytest.approx(own["spec_proposed"], rel=0.1), own
