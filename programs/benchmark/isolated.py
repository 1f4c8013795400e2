"""What users run, each in a process of its own: a real `just serve` process (programs/serve.py)
with one streaming client in this process, against the bare prefill + decode_step loop in a
clean worker process. Neither shares a process with the other or with transformers, so
neither pays for another thread's OpenMP team (see docs/inference.md, "One compute thread")."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from load import server as load_server

PROGRAMS = Path(__file__).resolve().parents[1]


def _env(threads: int | None) -> dict[str, str]:
    return {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}


class LoopProcess:
    """The worker's pipe: `generate(prompt, n)` -> its greedy tokens."""

    def __init__(self, process: subprocess.Popen):
        self.process = process

    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        self.process.stdin.write(json.dumps({"prompt": prompt, "new_tokens": new_tokens}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the loop worker exited with status {self.process.wait()}")
        return json.loads(line)["tokens"]


@contextlib.contextmanager
def loop_process(folder: Path, dtype: str, quantize: str | None, threads: int | None):
    command = [sys.executable, str(PROGRAMS / "benchmark" / "loop_worker.py"), str(folder), dtype]
    command += [quantize] if quantize else []
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(threads)
    )
    try:
        if not process.stdout.readline():
            raise RuntimeError(f"the loop worker exited with status {process.wait()}")
        yield LoopProcess(process)
    finally:
        process.stdin.close()
        process.wait(timeout=60)


@contextlib.contextmanager
def serve_process(
    folder: Path, dtype: str, quantize: str | None, threads: int | None
) -> Iterator[str]:
    """`just serve --model FOLDER --dtype DTYPE [--quantize Q]` on a free port; yields its URL."""
    flags = ["--dtype", dtype, "--max-waiting", "0"] + (
        ["--quantize", quantize] if quantize else []
    )
    log = Path(tempfile.mkdtemp(prefix="astrai-isolated-")) / "serve.log"
    with load_server.serve_process(folder, flags, log, timeout=300, env=_env(threads)) as url:
        yield url
