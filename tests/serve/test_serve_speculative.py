"""Speculative decoding through the server: the same greedy text over HTTP with and without it,
its counts in /stats and /metrics, and `just serve`'s flags and their errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest
from tiny_server import API_KEY, HELLO_A, HELLO_Q, MODEL, engine_for, serving

from astrai.config import ModelConfig, ServeConfig
from astrai.infer import speculate_step
from astrai.model import init_params, save_pretrained
from astrai.serve.metrics import speculation_summary

PROGRAM = Path(__file__).resolve().parents[2] / "programs" / "serve.py"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# the answer is in the conversation already: prompt lookup proposes it from the earlier turn
QUOTING = [
    {"role": "user", "content": HELLO_Q},
    {"role": "assistant", "content": HELLO_A},
    {"role": "user", "content": HELLO_Q},
]


@pytest.fixture(scope="module")
def program():
    spec = importlib.util.spec_from_file_location("serve_program", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chat_and_counts(tiny, **settings) -> tuple[str, dict, str]:
    """(greedy reply to QUOTING, /stats, /metrics) of a server over an Engine with settings."""
    with (
        engine_for(tiny, **settings) as engine,
        serving(engine, ServeConfig(api_key=API_KEY)) as url,
    ):
        body = {"model": MODEL, "messages": QUOTING, "temperature": 0, "max_tokens": 24}
        reply = httpx.post(url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=60)
        assert reply.status_code == 200, reply.text
        stats = httpx.get(url + "/stats", headers=HEADERS).json()
        metrics = httpx.get(url + "/metrics", headers=HEADERS).text
    return reply.json()["choices"][0]["message"]["content"], stats, metrics


def metric(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def test_lookup_gives_the_same_greedy_text_and_counts_what_it_kept(tiny):
    plain, plain_stats, plain_metrics = chat_and_counts(tiny)
    spec, stats, metrics = chat_and_counts(tiny, speculative="lookup", speculative_k=4)
    assert spec == plain == HELLO_A
    assert plain_stats["spec_steps"] == 0
    assert metric(plain_metrics, "astrai_speculative_accepted_tokens_total") == 0
    assert 0 < stats["spec_accepted"] <= stats["spec_proposed"] <= 4 * stats["spec_steps"]
    # every token but the first came from the same steps: fewer of them than tokens
    assert stats["steps"] < plain_stats["steps"]
    assert stats["spec_acceptance_rate"] == stats["spec_accepted"] / stats["spec_proposed"]
    assert stats["spec_tokens_per_step"] > 1
    for name, key in (
        ("astrai_speculative_accepted_tokens_total", "spec_accepted"),
        ("astrai_speculative_proposed_tokens_total", "spec_proposed"),
        ("astrai_speculative_verification_steps_total", "spec_steps"),
        ("astrai_speculative_watched_tokens_total", "spec_watched"),
    ):
        assert metric(metrics, name) == stats[key]
    assert "# TYPE astrai_speculative_accepted_tokens_total counter" in metrics
    assert metric(metrics, "astrai_spec_acceptance_rate") == stats["spec_acceptance_rate"]


def test_the_summary_of_no_speculation_is_zero():
    assert speculation_summary({"spec_steps": 0, "spec_proposed": 0, "spec_accepted": 0}) == {
        "spec_acceptance_rate": 0.0,
        "spec_tokens_per_step": 0.0,
    }
    summary = speculation_summary({"spec_steps": 4, "spec_proposed": 16, "spec_accepted": 12})
    assert summary == {"spec_acceptance_rate": 0.75, "spec_tokens_per_step": 4.0}


def test_the_model_as_its_own_draft_keeps_every_greedy_proposal(program, tmp_path, monkeypatch):
    # a draft as large as its target never pays for its own steps: verify all the same
    monkeypatch.setattr(speculate_step, "worth_verifying", lambda *a: True)
    folder = program.make_random_tiny(tmp_path / "tiny")
    flags = ["--speculative", "draft", "--draft-model", str(folder), "--speculative-k", "3"]
    cfg = program.serve_config(program.parse_args(flags), environ={})
    engine = program.load_engine(folder, cfg)
    try:
        (completion,) = engine.generate(["Hello"], max_tokens=12, temperature=0.0)
        stats = engine.stats()
    finally:
        engine.close()
    assert completion.usage.completion_tokens == 12 or completion.finish_reason == "stop"
    assert stats.spec_proposed > 0 and stats.spec_accepted == stats.spec_proposed
    assert "draft model" in program.describe_speculation(cfg)


def test_bad_speculation_flags_stop_the_server_at_start(program, tmp_path, capsys):
    folder = program.make_random_tiny(tmp_path / "tiny")
    model = ["--model", str(folder), "--port", "0"]
    assert program.main([*model, "--speculative", "draft"]) == 2
    assert "needs draft_model" in capsys.readouterr().err
    assert program.main([*model, "--draft-model", str(folder)]) == 2
    assert "only used with speculative" in capsys.readouterr().err
    assert program.main([*model, "--speculative", "lookup", "--speculative-k", "0"]) == 2
    assert "speculative_k must be positive" in capsys.readouterr().err
    missing = str(tmp_path / "missing")
    assert program.main([*model, "--speculative", "draft", "--draft-model", missing]) == 2
    assert f"--draft-model {missing}: not a model folder" in capsys.readouterr().err
    other = ModelConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64,
    )  # fmt: skip
    save_pretrained(tmp_path / "other", init_params(other, seed=0), other)
    flags = ["--speculative", "draft", "--draft-model", str(tmp_path / "other")]
    assert program.main([*model, *flags]) == 2
    assert "its vocabulary has 64 tokens, the model's" in capsys.readouterr().err
