"""`just serve` keeps at most one OpenMP team, the engine thread's while it works.

A thread that once ran a parallel op keeps its own team of OpenMP workers alive; with more
workers than cores libgomp sleeps between the hundreds of small parallel regions of a decode
step, which measured ~2x slower decoding. All torch work of the server runs on the engine
thread, which names itself before its team exists, so its workers carry its name, and ends its
team when it runs out of work. With one OpenMP thread there are no teams at all; with two, a
team started by any thread but the engine's adds a thread that does not carry its name.
(OpenBLAS, which numpy brings, keeps a pool of its own sized by the same variable; it is held
at one thread so it does not count.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from page_server import free_port, wait_healthy
from thread_names import thread_names, threads_become

import astrai
from astrai.config import ModelConfig
from astrai.infer.engine import THREAD_NAME
from astrai.tokenizer import Tokenizer

PROGRAM = Path(__file__).resolve().parents[2] / "programs" / "serve.py"

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir() or sys.platform != "linux",
    reason="reads thread names from /proc (Linux)",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    tok = Tokenizer.train(["one compute thread per process"] * 8, vocab_size=300)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=512,
    )
    astrai.save_pretrained(folder, astrai.init_params(cfg, seed=0), cfg, tokenizer=tok)
    return folder


def threads_after_a_request(
    model: Path, omp_threads: int, flags: list[str], program: Path = PROGRAM
) -> list[str]:
    """Start `just serve` with `omp_threads` OpenMP threads, complete one prompt over HTTP,
    and return the names of the server's threads once the engine thread is alone again (or
    after 10 s)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(omp_threads), "OPENBLAS_NUM_THREADS": "1"}
    command = [sys.executable, str(program), "--model", str(model), "--port", str(port),
               "--model-name", "m", "--log-level", "warning", *flags]  # fmt: skip
    process = subprocess.Popen(command, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        body = {"model": "m", "prompt": "one compute", "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        threads_become(THREAD_NAME, 1, process.pid)
        return thread_names(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize(
    "flags", [[], ["--quantize", "int8", "--dtype", "auto"], ["--quantize", "int4"]]
)
def test_no_openmp_team_outlives_the_engines_work(model, flags):
    names = {n: threads_after_a_request(model, n, flags) for n in (1, 2)}
    assert names[1].count(THREAD_NAME) == 1, names  # no team: the engine thread alone
    assert names[2].count(THREAD_NAME) == 1, names  # its team of two ended once idle
    others = {n: len(found) - found.count(THREAD_NAME) for n, found in names.items()}
    assert others[1] == others[2], names  # no other thread started a team
