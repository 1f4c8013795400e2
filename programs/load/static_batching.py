"""The reference: transformers static batching, what a user without a serving engine does.
Requests are grouped in arrival order into batches of B; a batch starts once its last request
has arrived and the previous batch is done, is left-padded and generated (greedy) to its
longest output. A per-step callback times each generated token, so a request's tokens are
timed as if streamed (the reference's most favourable reading).

Runs in its own process (`python static_batching.py SPEC.json OUT.json`), like the server.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def run_batches(folder: str, jobs: list[dict], batch: int, threads: int | None) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()

    class StepClock(StoppingCriteria):
        """Called once per generated token: records when it came, never stops."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    # warm-up on a small batch, so the first timed batch pays no one-time costs
    with torch.inference_mode():
        model.generate(
            torch.zeros(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False, pad_token_id=0
        )
    outcomes = []
    start = time.perf_counter()
    for first in range(0, len(jobs), batch):
        group = jobs[first : first + batch]
        time.sleep(max(0.0, start + max(j["arrival_s"] for j in group) - time.perf_counter()))
        width = max(len(j["prompt"]) for j in group)
        ids = torch.tensor([[0] * (width - len(j["prompt"])) + j["prompt"] for j in group])
        mask = torch.tensor(
            [[0] * (width - len(j["prompt"])) + [1] * len(j["prompt"]) for j in group]
        )
        longest = max(j["output_len"] for j in group)
        clock = StepClock()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]),
            )  # fmt: skip
        for j in group:
            stamps = [t - start for t in clock.times[: j["output_len"]]]
            outcomes.append(
                {"index": j["index"], "sent_s": j["arrival_s"], "chunk_s": stamps,
                 "completion_tokens": len(stamps), "finish_reason": "length", "error": None}
            )  # fmt: skip
    return outcomes


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    start = time.perf_counter()
    outcomes = run_batches(spec["model"], spec["jobs"], spec["batch"], spec.get("threads"))
    wall = max(max(o["chunk_s"]) for o in outcomes)
    with open(argv[1], "w") as out:
        json.dump(
            {"wall_s": wall, "outcomes": outcomes, "elapsed_s": time.perf_counter() - start}, out
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
