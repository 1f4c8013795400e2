"""One side of the adapters section (adapters.py) in a process of its own, the only thread
there doing torch work (docs/inference.md, "One compute thread").

    python programs/benchmark/adapter_worker.py SPEC_JSON

SPEC_JSON: {"side": "adapters" | "base" | "merged", "folder", "device", "dtype", "quantize",
"adapters": count, "rank", "targets": [module names], "streams", "max_len"}. The sides:

- adapters: one Engine with every adapter loaded; prompt i runs adapter i % count, all in one
  batch;
- base: the same Engine settings, no adapter: every prompt on the base model;
- merged: each adapter served as its own merged model, one after another: the Engine's
  weights swapped for the next adapter's merged ones (not timed), then that adapter's prompts
  generated together (timed).

The worker prints {"ready": true, "facts": {"param_bytes", "adapter_bytes"}}, then answers each
request line ({"prompts": [[ids]], "new_tokens": n}) with {"tokens": [[ids]], "seconds": s}:
greedy completions of exactly n tokens, and the seconds their generation took.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import astrai
from astrai.config import LoraConfig
from astrai.infer import Engine
from astrai.infer.pages import pages_for

PAGE_SIZE = 16


def bench_adapters(params, cfg, count: int, rank: int, targets) -> dict:
    """{name: (lora params, LoraConfig)}: `count` adapters with random A and B, in float32
    (as load_lora reads a folder; the engine keeps them in its dtype)."""
    adapters = {}
    for i in range(count):
        weights = {k: v.float() for k, v in params.items() if v.is_floating_point()}
        lora = astrai.init_lora(weights, cfg, rank, 2.0 * rank, tuple(targets), seed=i)
        g = torch.Generator().manual_seed(1000 + i)
        for pair in lora["weights"].values():
            pair["B"] = torch.randn(pair["B"].shape, generator=g) * 0.02
        adapters[f"adapter-{i}"] = (lora, LoraConfig(rank=rank, alpha=2.0 * rank, targets=targets))
    return adapters


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    side, count, streams = spec["side"], spec["adapters"], spec["streams"]
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    params, cfg = astrai.load_pretrained(Path(spec["folder"]), dtype=dtype, device=device)
    targets = tuple(spec["targets"])
    adapters = bench_adapters(params, cfg, count, spec["rank"], targets)
    names = list(adapters)
    engine = Engine(
        params if side != "merged" else astrai.merge_lora(params, adapters[names[0]][0]),
        cfg,
        None,
        num_pages=streams * pages_for(spec["max_len"], PAGE_SIZE) + 8,
        page_size=PAGE_SIZE,
        max_batch=streams,
        max_seq_len=pages_for(spec["max_len"], PAGE_SIZE) * PAGE_SIZE,
        device=str(device),
        dtype=spec["dtype"],
        quantize=spec["quantize"],
        max_adapters=count,
        max_adapter_rank=spec["rank"],
        adapter_targets=targets,
    )  # fmt: skip
    if side == "adapters":
        for name, source in adapters.items():
            engine.load_adapter(name, source)
    param_bytes = sum(v.numel() * v.element_size() for v in params.values())
    facts = {"param_bytes": param_bytes, "adapter_bytes": engine.adapter_bytes}
    print(json.dumps({"ready": True, "facts": facts}), flush=True)
    greedy = dict(temperature=0.0, ignore_eos=True)
    for line in sys.stdin:
        request = json.loads(line)
        prompts, n = request["prompts"], request["new_tokens"]
        chosen = [names[i % count] for i in range(len(prompts))]
        tokens: list = [None] * len(prompts)
        seconds = 0.0
        if side == "merged":
            for name in names:
                rows = [i for i, c in enumerate(chosen) if c == name]
                engine.update_params(astrai.merge_lora(params, adapters[name][0]))  # not timed
                start = time.perf_counter()
                done = engine.generate([prompts[i] for i in rows], max_tokens=n, **greedy)
                seconds += time.perf_counter() - start
                for i, completion in zip(rows, done):
                    tokens[i] = completion.token_ids
        else:
            start = time.perf_counter()
            which = chosen if side == "adapters" else None
            done = engine.generate(prompts, adapter=which, max_tokens=n, **greedy)
            seconds = time.perf_counter() - start
            tokens = [c.token_ids for c in done]
        print(json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)
    engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
