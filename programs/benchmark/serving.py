"""Serving under load: the Starlette app on a loopback port (uvicorn, in this process) and N
clients streaming completions at once, each timing the reads of its stream."""

from __future__ import annotations

import contextlib
import http.client
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
from load.stream import handover_gaps, time_per_output_token, token_arrivals

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
    """One streamed /v1/completions request -> its start and its arrivals (load/stream.py).

    A blocking http.client reader keeps the client's CPU small (each read is only stamped and
    kept; the events are parsed once the stream has ended), where httpx's async line iterator
    and json took ~0.5 ms of CPU per token: on a machine with two cores that CPU is taken from
    the server's compute threads, and the figure would measure the client."""
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
    reads = []
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            text = response.read().decode(errors="replace")
            raise RuntimeError(f"server answered {response.status}: {text[:300]}")
        while data := response.read1(1 << 16):  # one read of what has arrived (de-chunked)
            reads.append((time.perf_counter(), data))
    finally:
        connection.close()
    arrivals = token_arrivals(reads)
    if not arrivals.stamps:
        raise RuntimeError("a stream ended without any text")
    return {"start": start, "arrivals": arrivals}


def stream_load(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """All prompts streamed concurrently, one client thread each -> wall time, each
    completion's text and its latencies: time to first token, time per output token after
    the first, and the gaps between hand-overs (tokens that arrive together are one)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda p: _one_stream(url, p, new_tokens), prompts))
    wall = time.perf_counter() - start
    stamps = [r["arrivals"].stamps for r in results]
    return {
        "wall_s": wall,
        "texts": [r["arrivals"].text for r in results],
        "ttft_s": [s[0] - r["start"] for s, r in zip(stamps, results)],
        "tpot_s": [t for s in stamps if (t := time_per_output_token(s)) is not None],
        "handover_s": [gap for s in stamps for gap in handover_gaps(s)],
    }


LATENCIES = {
    "ttft": "time to first token",
    "tpot": "time per output token",
    "handover": "gap between hand-overs",
}


def latency_summary(loads: list[dict]) -> dict[tuple[str, int], float]:
    """{(kind, percentile): ms} for each kind of LATENCIES, pooled over every request (every
    gap) of every round."""
    pooled = {kind: [t for load in loads for t in load[f"{kind}_s"]] or [0.0] for kind in LATENCIES}
    return {(kind, q): percentile(v, q) * 1000 for kind, v in pooled.items() for q in (50, 90, 99)}
