"""Serving under load: the Starlette app on a loopback port (uvicorn, in this process) and N
clients streaming completions at once with httpx, each timing its own chunks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator

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


async def _one_stream(client, url: str, prompt: list[int], new_tokens: int) -> dict:
    """One streamed /v1/completions request -> its start, chunk arrival times and token count."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps, tokens = [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"server answered {response.status_code}: {text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(choice.get("text") for choice in chunk.get("choices") or []):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if not stamps:
        raise RuntimeError("a stream ended without any text")
    return {"start": start, "stamps": stamps, "tokens": tokens or len(stamps)}


async def _load(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        streams = [_one_stream(client, url, p, new_tokens) for p in prompts]
        results = await asyncio.gather(*streams)
        return time.perf_counter() - start, results


def stream_load(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """All prompts streamed concurrently -> wall time, tokens and per-request latencies."""
    wall, results = asyncio.run(_load(url, prompts, new_tokens))
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
