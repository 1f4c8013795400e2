"""The load generator's client: every job sent at its arrival time as a streamed
/v1/completions request with the official `openai` async client, each network read of the
stream timed as it arrives and read as tokens afterwards (load/stream.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

from .stream import token_arrivals
from .workloads import Job


@dataclass
class Outcome:
    """What one request saw. Times are seconds after the run's start."""

    index: int
    sent_s: float
    chunk_s: list[float] = field(default_factory=list)  # arrival of each token (chunk with text)
    completion_tokens: int | None = None  # from the final usage chunk
    finish_reason: str | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


async def _one(client, model: str, job: Job, start: float) -> Outcome:
    await asyncio.sleep(max(0.0, start + job.arrival_s - time.perf_counter()))
    out = Outcome(job.index, time.perf_counter() - start)
    reads = []
    try:
        response = client.completions.with_streaming_response.create(
            model=model,
            prompt=job.prompt,
            max_tokens=job.output_len,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async with response as stream:
            async for data in stream.iter_bytes():
                reads.append((time.perf_counter() - start, data))
        arrivals = token_arrivals(reads)
        out.chunk_s, out.completion_tokens = arrivals.stamps, arrivals.completion_tokens
        out.finish_reason = arrivals.finish_reason
    except Exception as exc:  # recorded, counted as a failed request
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _run(base_url: str, model: str, jobs: list[Job]) -> tuple[float, list[Outcome]]:
    from openai import AsyncOpenAI

    # no retries: a retried request would be served twice and counted once
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=3600)
    async with client:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(_one(client, model, job, start) for job in jobs))
        return time.perf_counter() - start, list(outcomes)


def send_all(base_url: str, model: str, jobs: list[Job]) -> tuple[float, list[Outcome]]:
    """Send every job at its arrival time; returns (wall seconds, outcomes in job order)."""
    return asyncio.run(_run(base_url, model, jobs))
