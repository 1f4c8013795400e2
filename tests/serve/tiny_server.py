"""A tiny model that answers known prompts with known text, and a real server around it.

The model is trained for a few dozen steps to memorise two answers: a tool call for WEATHER_Q
(when tools are offered) and HELLO_A for HELLO_Q. Its chat template is a compact ChatML so
the prompts stay short and the training fast. Each test module starts its own server (uvicorn
on a free 127.0.0.1 port, in a background thread) with `serving`.
"""

from __future__ import annotations

import contextlib
import time

import torch

import astrai
from astrai.config import ModelConfig, ServeConfig
from astrai.infer import Engine
from astrai.serve.app import make_app
from astrai.serve.background import serve_in_background
from astrai.serve.tools import tool_spec
from astrai.tokenizer import Tokenizer

MODEL = "tiny-test"
API_KEY = "sk-test-key"
WEATHER_Q = "What is the weather in Paris?"
CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL_TEXT = f"<tool_call>\n{CALL_JSON}\n</tool_call>"
HELLO_Q = "Say hello."
HELLO_A = "Hello! The weather is nice today."
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}

COMPACT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:"
    "{%- for t in tools %} {{ t.function.name }}{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def weather_tool_spec() -> dict:
    return tool_spec(WEATHER_TOOL["name"], WEATHER_TOOL["description"], WEATHER_TOOL["parameters"])


def memorise(params, cfg, sequences: list[tuple[list[int], list[int]]], steps: int = 400):
    """Train until greedy decoding reproduces every answer after its prompt."""
    width = max(len(p) + len(a) for p, a in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    labels = torch.full((len(sequences), width), -100)
    for row, (prompt, answer) in enumerate(sequences):
        seq = prompt + answer
        tokens[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt) - 1 : len(seq) - 1] = torch.tensor(answer)
    params = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.Adam(params.values(), lr=1e-2)
    target = labels != -100
    for _ in range(steps):
        logits = astrai.forward(params, cfg, tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        margin = logits.detach().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        if bool((margin[target] > -0.1).all()):  # every answer token is the clear argmax
            break
    return {k: v.detach() for k, v in params.items()}


def build_tiny():
    """(params, cfg, tokenizer) of the memorising model."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on a busy machine: more threads only contend
    try:
        return _build_tiny()
    finally:
        torch.set_num_threads(threads)


def _build_tiny():
    torch.manual_seed(0)
    chat = Tokenizer.train(["a"], vocab_size=300)  # only renders the prompts' text
    chat.chat_template = COMPACT_TEMPLATE
    prompts = [
        chat.apply_chat_template(
            [{"role": "user", "content": WEATHER_Q}], tools=[weather_tool_spec()]
        ),
        chat.apply_chat_template([{"role": "user", "content": HELLO_Q}]),
    ]
    answers = [CALL_TEXT, HELLO_A]
    tok = Tokenizer.train([*prompts, *answers] * 8, vocab_size=400)
    tok.chat_template = COMPACT_TEMPLATE
    end = tok.token_to_id("<|im_end|>")
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=512,
    )
    sequences = [(tok.encode(p), [*tok.encode(a), end]) for p, a in zip(prompts, answers)]
    params = memorise(astrai.init_params(cfg, seed=0), cfg, sequences)
    return params, cfg, tok


def no_end_bias(tok) -> dict[str, float]:
    """logit_bias (OpenAI form) that keeps the model from ever ending on its own."""
    return {str(i): -100.0 for i in tok.stop_ids}


@contextlib.contextmanager
def serving(engine, serve_cfg: ServeConfig | None = None, model_name: str = MODEL):
    """Run the app on a free loopback port in a background thread; yields the base URL."""
    with serve_in_background(make_app(engine, model_name, serve_cfg or ServeConfig())) as url:
        yield url


@contextlib.contextmanager
def engine_for(tiny, **kwargs):
    params, cfg, tok = tiny
    engine = Engine(params, cfg, tok, **kwargs)
    try:
        yield engine
    finally:
        engine.close()


def wait_until_idle(engine, timeout: float = 10.0):
    """The engine's stats once nothing runs, waits or holds pages (or the last seen)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = stats.running == 0 and stats.waiting == 0 and stats.pages_used == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def wait_for(engine, key: str, value: int, timeout: float = 10.0) -> None:
    """Until engine.stats().<key> == value (the stats are a snapshot taken between steps)."""
    deadline = time.monotonic() + timeout
    while getattr(engine.stats(), key) != value:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)
