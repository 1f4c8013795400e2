"""The bare prefill + decode_step loop in a process of its own, one thread doing torch work:
the clean baseline `just serve` is compared with. Reads one JSON request per line on stdin
({"prompt": [...], "new_tokens": n}) and answers one line ({"tokens": [...]}).

    python programs/benchmark/loop_worker.py FOLDER DTYPE [QUANTIZE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmark package

import astrai
from benchmark.ours import greedy_decode, prepared


def main(folder: str, dtype: str, quantize: str | None = None) -> None:
    params, cfg = astrai.load_pretrained(folder, dtype=dtype)
    params = prepared(params, cfg, quantize)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        tokens = greedy_decode(params, cfg, request["prompt"], request["new_tokens"])
        print(json.dumps({"tokens": tokens}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
