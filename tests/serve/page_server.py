"""A tiny model that knows three answers, saved to a folder, and `just serve` processes around it.

The chat page tests drive the real program (programs/serve.py, what `just serve` runs) in a
child process, as a user would. The model memorised: a short greeting in Markdown, a reply
full of HTML that must stay text, and an endless row of " tick" that streams until Stop or
max tokens (the tick token follows itself, so greedy decoding never ends the turn).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from tiny_server import COMPACT_TEMPLATE, memorise

import astrai
from astrai.config import ModelConfig
from astrai.tokenizer import Tokenizer

PROGRAM = Path(__file__).resolve().parents[2] / "programs" / "serve.py"
HELLO_Q = "Say hello."
HELLO_A = "Hello! I am a **tiny** model."
HTML_Q = "Show me some HTML."
HTML_A = "Careful: <img src=x onerror=alert(1)> and <script>alert(2)</script> are `code`."
TICK_Q = "Count the ticks."
TICK_A = " tick" * 40  # no end of turn: the model learns that a tick follows a tick


def build_page_model(folder: Path) -> Path:
    """Train the three answers (a few seconds on one thread) and save the model to `folder`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        chat = Tokenizer.train(["a"], vocab_size=300)  # only renders the prompts' text
        chat.chat_template = COMPACT_TEMPLATE
        questions, answers = [HELLO_Q, HTML_Q, TICK_Q], [HELLO_A, HTML_A, TICK_A]
        prompts = [chat.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        tok = Tokenizer.train([*prompts, *answers] * 8, vocab_size=400)
        tok.chat_template = COMPACT_TEMPLATE
        end = [tok.token_to_id("<|im_end|>")]
        sequences = [
            (tok.encode(prompt), tok.encode(answer) + (end if answer != TICK_A else []))
            for prompt, answer in zip(prompts, answers)
        ]
        cfg = ModelConfig(
            vocab_size=tok.vocab_size,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            max_position_embeddings=4096,
        )
        params = memorise(astrai.init_params(cfg, seed=0), cfg, sequences)
    finally:
        torch.set_num_threads(threads)
    astrai.save_pretrained(folder, params, cfg, tokenizer=tok)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the server at {url} did not become healthy in {timeout:.0f} s")


def serve_command(model: Path, port: int, flags: list[str]) -> list[str]:
    """What `just serve --model MODEL ...` runs."""
    return [sys.executable, str(PROGRAM), "--model", str(model), "--model-name", "page-test",
            "--port", str(port), "--log-level", "warning", *flags]  # fmt: skip


@contextlib.contextmanager
def serve_processes(model: Path, *flag_sets: list[str]):
    """One `just serve` process per list of extra flags, started together; yields their URLs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny matmuls: more threads only contend
    ports = [free_port() for _ in flag_sets]
    processes = [subprocess.Popen(serve_command(model, port, flags), env=env)
                 for port, flags in zip(ports, flag_sets)]  # fmt: skip
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url, process in zip(urls, processes):
            wait_healthy(url, process)
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
