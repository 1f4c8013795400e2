"""programs/chat.py driven through a pipe, as a user (or a script) would drive it."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import astrai as ai
from astrai.infer import Engine
from astrai.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
CHAT = str(ROOT / "programs" / "chat.py")
ENV = {**os.environ, "PYTHONIOENCODING": "utf-8"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random tiny model whose tokenizer has no special tokens: nothing stops a reply but its
    length, so every reply has exactly --max-tokens tokens."""
    path = tmp_path_factory.mktemp("chat-model")
    texts = ["hello world, the quick brown fox jumps over the lazy dog. " * 4] * 8
    tok = Tokenizer.train(texts, vocab_size=300, special_tokens=[])
    cfg = ai.ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=4096,
        initializer_range=0.3,  # decisive greedy choices: no near-ties between processes
    )
    ai.save_pretrained(path, ai.init_params(cfg, seed=0), cfg, tokenizer=tok)
    return path


def run_chat(*args, stdin: str = "", cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, CHAT, *args],
        input=stdin.encode(),
        capture_output=True,
        cwd=cwd,
        env=ENV,
        timeout=120,
    )


def test_help_and_missing_models(tmp_path):
    done = run_chat("--help")
    assert done.returncode == 0
    assert all(word in done.stdout.decode() for word in ("/reset", "/exit", "--system"))

    done = run_chat(cwd=tmp_path)  # no --model and no runs/demo/model here
    assert done.returncode == 2
    assert "just demo" in done.stderr.decode()

    done = run_chat("--model", str(tmp_path / "nothing"))
    assert done.returncode == 2
    assert "cannot load" in done.stderr.decode()


def test_piped_conversation_keeps_history_until_reset(model_dir):
    system, n = "You answer briefly.", 6
    lines = ["hello there", "and what next?", "/reset", "hello there"]
    done = run_chat(
        "--model", str(model_dir), "--system", system, "--temperature", "0", "--max-tokens", str(n),
        stdin="\n".join(lines) + "\n",  # then the end of input, which ends the chat
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()

    # The same conversation replayed through an Engine: each reply sees every earlier turn.
    params, cfg = ai.load_pretrained(model_dir)
    tok = Tokenizer.from_pretrained(model_dir)
    with Engine(params, cfg, tok, max_batch=1) as engine:

        def answer(messages):
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
            return engine.generate([prompt], max_tokens=n, temperature=0)[0].text

        first = [{"role": "system", "content": system}, {"role": "user", "content": lines[0]}]
        r1 = answer(first)
        r2 = answer(
            [*first, {"role": "assistant", "content": r1}, {"role": "user", "content": lines[1]}]
        )
        alone = answer([first[0], {"role": "user", "content": lines[1]}])
    assert r2 != alone  # so the output below shows that the second reply saw the first turn
    assert done.stdout.decode() == f"{r1}\n{r2}\n{r1}\n"  # after /reset, the first reply again
    assert "(conversation forgotten)" in done.stderr.decode()


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(model_dir):
    # --max-tokens far beyond the context: uninterrupted, the reply would fill all 4096 positions
    args = ["--model", str(model_dir), "--max-tokens", "100000", "--seed", "0"]
    proc = subprocess.Popen(
        [sys.executable, CHAT, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=ENV,
    )
    try:
        proc.stdin.write(b"hello\n")
        proc.stdin.flush()
        assert os.read(proc.stdout.fileno(), 1)  # the reply has started streaming
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(b"/reset\n/exit\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    assert err.decode().splitlines()[-2:] == ["(stopped)", "(conversation forgotten)"]


def test_speculation_flags_reach_the_engine_and_bad_ones_stop_it(model_dir, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("chat_program", CHAT)
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    args = program.parse_args(["--speculative", "lookup", "--speculative-k", "3"])
    speculation = program.speculation_settings(args)
    prompt = "hello world, the quick brown fox hello world, the quick"
    replies = []
    for settings in (None, speculation):
        engine, _ = program.load_engine(model_dir, speculation=settings)
        with engine:
            replies.append(engine.generate([prompt], max_tokens=12, temperature=0)[0].text)
            config = engine.config
    assert (config.speculative, config.speculative_k) == ("lookup", 3)
    assert replies[0] == replies[1]

    model = ["--model", str(model_dir)]
    missing = tmp_path / "none"
    assert program.main([*model, "--speculative", "draft", "--draft-model", str(missing)]) == 2
    assert f"--draft-model {missing}: not a model folder" in capsys.readouterr().err
    assert program.main([*model, "--speculative", "draft"]) == 2
    assert "needs draft_model" in capsys.readouterr().err
