"""The exported GGUF file run by llama.cpp itself: greedy tokens, logits, tokenization and the
chat template must be ours. Needs the `peer` extra (it compiles llama.cpp): `just test-peer`."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import astrai as ai
from astrai.config import RopeScaling, train_config
from astrai.export import llamacpp as lc
from astrai.export import save_gguf
from astrai.train import init_train_state, train_step

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "programs"))
import demo_data  # noqa: E402

N = 32  # greedy tokens compared
BASE = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    # wide weights: logits far apart, so a greedy choice is no coin toss between near-ties
    initializer_range=0.2,
)
# float32 sums in another order: a few ulps per product, grown over hidden-size sums and layers
F32_LOGIT_TOLERANCE = 2000 * torch.finfo(torch.float32).eps

VARIANTS = {
    "gqa, tied": {},
    "biases, untied": {"attention_bias": True, "tie_word_embeddings": False},
    "qk-norm (qwen3)": {"use_qk_norm": True},
    "head_dim 32": {"head_dim": 32},
    "rope linear": {"rope_scaling": RopeScaling("linear", 2.0)},
    "rope llama3": {
        "rope_scaling": RopeScaling("llama3", 8.0, original_max_position_embeddings=64)
    },
    "rope yarn": {"rope_scaling": RopeScaling("yarn", 4.0, original_max_position_embeddings=64)},
}


@pytest.fixture(autouse=True)
def quiet():
    lc.quiet_logs()


def our_greedy(params, cfg, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens by full recomputation, and the logits after the prompt."""
    tokens = torch.tensor([prompt])
    first = None
    with torch.no_grad():
        for _ in range(n):
            logits = ai.forward(params, cfg, tokens)[0, -1]
            first = logits if first is None else first
            tokens = torch.cat([tokens, logits.argmax().view(1, 1)], dim=1)
    return tokens[0, len(prompt) :].tolist(), first


def leading(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_llamacpp(path, prompts, n=N):
    m = lc.load(path, threads=2, n_ctx=256, n_seq=len(prompts))
    try:
        return lc.prompt_logits(m, prompts), lc.greedy(m, prompts, n)
    finally:
        lc.close(m)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_random_model_f32_gives_our_logits_and_greedy_tokens(tmp_path, variant):
    cfg = ai.ModelConfig(**BASE, **VARIANTS[variant])
    params = ai.init_params(cfg, seed=0)
    save_gguf(tmp_path / "m.gguf", params, cfg, type="f32")
    prompts = [[1, 5, 9, 200, 17], list(range(40, 80))]  # the second reaches past 64 positions
    logits, tokens = run_llamacpp(tmp_path / "m.gguf", prompts)
    for i, prompt in enumerate(prompts):
        ours, our_logits = our_greedy(params, cfg, prompt, N)
        scale = our_logits.abs().max().item()
        diff = (torch.from_numpy(logits[i]) - our_logits).abs().max().item()
        assert diff <= F32_LOGIT_TOLERANCE * max(scale, 1.0), (variant, diff, scale)
        assert tokens[i] == ours, variant


# --- a trained model with its tokenizer -----------------------------------------------------


def demo_texts(count: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        a, op, b = demo_data.problem(rng, 99)
        question = demo_data.question(rng, a, op, b)
        chats.append(
            [
                {"role": "system", "content": demo_data.SYSTEM},
                {"role": "user", "content": question},
                {"role": "assistant", "content": demo_data.answer(a, op, b)},
            ]
        )
    return chats


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny chat model trained for a few dozen steps on the demo's arithmetic conversations,
    with the demo's kind of tokenizer (byte-level BPE, digits split, ChatML)."""
    chats = demo_texts(400)
    tokenizer = ai.Tokenizer.train(
        [tokenizer_text for c in chats for tokenizer_text in (m["content"] for m in c)],
        vocab_size=384,
        split_digits=True,
    )
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=False) for c in chats]
    rows = [tokenizer.encode(t)[:96] for t in texts]
    rows = [r + [tokenizer.pad_id] * (96 - len(r)) for r in rows]
    data = torch.tensor(rows)
    model = {**BASE, "vocab_size": tokenizer.vocab_size, "initializer_range": 0.02}
    cfg = ai.ModelConfig(**model)
    train_cfg = train_config(
        {
            "kind": "seq",
            "max_steps": 40,
            "batch_size": 16,
            "progress": False,
            "model": model,
            "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
            "schedule": {"name": "constant"},
            "data": {"source": "synthetic", "seq_len": 96},
        },
        "test",
    )
    torch.manual_seed(0)
    state = init_train_state(ai.init_params(cfg, seed=0), train_cfg)
    losses = []
    for step in range(40):
        state, metrics = train_step(state, {"input_ids": data[16 * step % 384 :][:16]})
        losses.append(metrics["loss"])
    assert losses[-1] < losses[0] / 2  # it learned something: its greedy text is no noise
    params = state.params
    folder = tmp_path_factory.mktemp("trained")
    ai.save_pretrained(folder / "model", params, cfg, tokenizer=tokenizer)
    return folder, params, cfg, tokenizer


def export(folder: Path, type: str) -> Path:
    """The file `just export` writes (programs/export.py, run as the recipe runs it)."""
    out = folder / f"model-{type}.gguf"
    if not out.exists():
        args = ["--model", str(folder / "model"), "--format", "gguf", "--out", str(out)]
        done = subprocess.run(
            [sys.executable, str(ROOT / "programs/export.py"), *args, "--type", type],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
    return out


def chat_prompt(tokenizer, question: str) -> list[int]:
    messages = [
        {"role": "system", "content": demo_data.SYSTEM},
        {"role": "user", "content": question},
    ]
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


@pytest.mark.parametrize(("type", "least"), [("f32", N), ("bf16", N // 2), ("q8_0", N // 2)])
def test_trained_model_greedy_tokens(trained, type, least):
    """f32: every token ours; bf16 and q8_0 round the weights, so the greedy paths may part
    after a while, but most leading tokens must agree."""
    folder, params, cfg, tokenizer = trained
    prompts = [chat_prompt(tokenizer, q) for q in ("What is 23 + 45?", "Compute 81 - 17.")]
    _, tokens = run_llamacpp(export(folder, type), prompts)
    for prompt, theirs in zip(prompts, tokens):
        ours, _ = our_greedy(params, cfg, prompt, N)
        assert leading(theirs, ours) >= least, (type, tokenizer.decode(ours), tokenizer.decode(theirs))  # fmt: skip


def q4_0_rounded(params: dict) -> dict:
    """Our weights as a Q4_0 file holds them: each matrix whose rows are whole blocks of 32
    through gguf's own Q4_0 rounding (the blocks lie along rows, which the q/k permutation of
    the export only reorders), the vectors as they are."""
    import gguf

    kind = gguf.GGMLQuantizationType.Q4_0

    def rounded(w: torch.Tensor) -> torch.Tensor:
        if w.dim() != 2 or w.shape[1] % 32:
            return w
        blocks = gguf.quants.quantize(w.detach().float().numpy(), kind)
        return torch.from_numpy(gguf.quants.dequantize(blocks, kind).copy()).reshape(w.shape)

    return {key: rounded(w) for key, w in params.items()}


def test_trained_model_q4_0_gives_our_greedy_tokens_on_the_same_4_bit_weights(trained):
    """`just export --type q4_0` run by llama.cpp against our recomputation with the weights the
    file holds: llama.cpp multiplies them with activations rounded to 8 bits (Q8_0) and we in
    float32, so the greedy paths may part after a while, but most leading tokens agree."""
    folder, params, cfg, tokenizer = trained
    prompts = [chat_prompt(tokenizer, q) for q in ("What is 23 + 45?", "Compute 81 - 17.")]
    _, tokens = run_llamacpp(export(folder, "q4_0"), prompts)
    rounded = q4_0_rounded(params)
    for prompt, theirs in zip(prompts, tokens):
        ours, _ = our_greedy(rounded, cfg, prompt, N)
        assert leading(theirs, ours) >= N // 2, (tokenizer.decode(ours), tokenizer.decode(theirs))


def test_trained_model_tokenizer_and_chat_template(trained):
    folder, _, _, tokenizer = trained
    m = lc.load(export(folder, "f32"), threads=2)
    try:
        texts = [
            "What is 123 + 4567?",
            "  two spaces, tabs\tand\nnew lines\n\n",
            "naïve café — ünïcödé 😀 ok",
            "<|im_start|>user\nhi<|im_end|>\n",
            "it's we'll they're 1,000.5",
        ]
        for text in texts:
            assert lc.tokenize(m, text) == tokenizer.encode(text), text
        template = lc.chat_template(m)
        assert template == tokenizer.chat_template
        messages = [
            {"role": "system", "content": demo_data.SYSTEM},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "2 + 2 = 4"},
            {"role": "user", "content": "And 3 + 3?"},
        ]
        for prompt in (True, False):
            ours = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt)
            assert lc.apply_chat_template(template, messages, prompt) == ours
    finally:
        lc.close(m)
