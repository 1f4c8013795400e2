"""Serving under load: the Starlette app on a loopback port (uvicorn, in this process) and N
clients streaming completions at once, each timing its own chunks."""

from __future__ import annotations

import contextlib
import http.client
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec

from .timing import percentile

MODEL_NAME = "bench"


@contextlib.contextmanager
def serving(engine) -> Iterator[str]:
    """Run the app around `engine` on a free 127.0.0.1 port in a background thread; yields
    the base URL and stops the server on exit (the engine stays open)."""
    from astrai.config import ServeConfig
    from astrai.serve.app import make_app
    from astrai.serve.background import serve_in_background

    app = make_app(engine, MODEL_NAME, ServeConfig(log_level="warning", max_waiting=0))
    with serve_in_background(app) as url:
        yield url


def _one_stream(url: str, prompt: list[int], new_tokens: int) -> dict:
    """One streamed /v1/completions request -> its start, chunk arrival times and token count.

    A blocking http.client reader with msgspec parses a chunk in a few microseconds, where
    httpx's async line iterator and json took ~0.5 ms of CPU per token: on a machine with two
    cores that CPU is taken from the server's compute threads, and the figure would measure the
    client."""
    body = msgspec.json.encode(
        {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=600)
    start = time.perf_counter()
    stamps, tokens = [], None
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            text = response.read().decode(errors="replace")
            raise RuntimeError(f"server answered {response.status}: {text[:300]}")
        for line in response:  # http.client undoes the chunked transfer encoding
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = msgspec.json.decode(line[6:])
            if any(choice.get("text") for choice in chunk.get("choices") or []):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    finally:
        connection.close()
    if not stamps:
        raise RuntimeError("a stream ended without any text")
    return {"start": start, "stamps": stamps, "tokens": tokens or len(stamps)}


def stream_load(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """All prompts streamed concurrently, one client thread each -> wall time, tokens and
    per-request latencies."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda p: _one_stream(url, p, new_tokens), prompts))
    wall = time.perf_counter() - start
    for r in results:
        if r["tokens"] != new_tokens:
            raise RuntimeError(f"a stream gave {r['tokens']} tokens instead of {new_tokens}")
    return {
        "wall_s": wall,
        "tokens": sum(r["tokens"] for r in results),
        "ttft_s": [r["stamps"][0] - r["start"] for r in results],
        "itl_s": [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])],
    }


def latency_summary(loads: list[dict]) -> dict[str, float]:
    """Time to first token and inter-token latency percentiles in ms, pooled over every
    request of every round."""
    ttft = [t for load in loads for t in load["ttft_s"]]
    itl = [t for load in loads for t in load["itl_s"]] or [0.0]
    quantiles = (50, 90, 99)
    return {f"ttft_p{q}_ms": percentile(ttft, q) * 1000 for q in quantiles} | {
        f"itl_p{q}_ms": percentile(itl, q) * 1000 for q in quantiles
    }
