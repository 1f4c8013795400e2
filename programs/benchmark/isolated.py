"""What users run, each in a process of its own: the Engine, the bare prefill + decode_step loop
and transformers' generate in side workers (programs/benchmark/side_worker.py), each training
stepper in a train worker (programs/benchmark/train_worker.py), and a real `just serve`
process (programs/serve.py) with streaming clients in the benchmark's process.
None shares a process with another, so none pays for another thread's OpenMP team (see
docs/inference.md, "One compute thread"), and none of them with the benchmark's own work."""

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


def _answer(process: subprocess.Popen) -> dict:
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"the side worker exited with status {process.wait()}")
    return json.loads(line)


class SideProcess:
    """A worker's pipe: `ask(request)` -> its answer, one JSON line each way; for a side
    worker, `generate(prompts, n)` -> its greedy completions, and `counts`, the engine's
    cumulative speculative counts after the last call."""

    def __init__(self, process: subprocess.Popen, facts: dict):
        self.process, self.facts, self.counts = process, facts, {}

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return _answer(self.process)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        answer = self.ask({"prompts": prompts, "new_tokens": new_tokens})
        self.counts = answer.get("counts", {})
        return answer["tokens"]


@contextlib.contextmanager
def side_process(
    spec: dict, threads: int | None, worker: str = "side_worker.py"
) -> Iterator[SideProcess]:
    """programs/benchmark/WORKER for spec (its docstring lists the keys), started and ready;
    stopped on exit."""
    command = [sys.executable, str(PROGRAMS / "benchmark" / worker), json.dumps(spec)]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(threads)
    )
    try:
        yield SideProcess(process, _answer(process)["facts"])
    finally:
        process.stdin.close()
        process.wait(timeout=60)


@contextlib.contextmanager
def side_processes(
    specs: dict[str, dict], threads: int | None, worker: str = "side_worker.py"
) -> Iterator[dict]:
    """{name: SideProcess} for {name: spec}, each in a process of its own."""
    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(side_process(spec, threads, worker))
            for name, spec in specs.items()
        }


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
