"""A real `just serve` process (programs/serve.py) on a free loopback port, for the load
generator to talk to over HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

SERVE = Path(__file__).resolve().parents[1] / "serve.py"
MODEL_NAME = "bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
        with contextlib.suppress(OSError):
            get_json(f"{url}/health")
            return
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health in {timeout:.0f} s")


@contextlib.contextmanager
def serve_process(
    model: Path, flags: list[str], log: Path, timeout: float = 120, env: dict | None = None
) -> Iterator[str]:
    """Run `programs/serve.py --model MODEL FLAGS` until the block ends; yields its base URL.
    Its output goes to `log`; `env` replaces this process's environment."""
    port = free_port()
    command = [sys.executable, str(SERVE), "--model", str(model), "--port", str(port)]
    command += ["--model-name", MODEL_NAME, "--log-level", "warning", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env or os.environ
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, timeout)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


IDLE_KEYS = ("running", "waiting", "pages_used")


def idle_stats(url: str, timeout: float = 10) -> dict:
    """/stats once no request runs or waits (the snapshot trails the last step a little)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = get_json(f"{url}/stats")
        if not (stats["running"] or stats["waiting"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
