"""llama.cpp as a peer in the benchmark (`--peer llama.cpp`).

The run's weights are exported to GGUF as F32, BF16 and Q8_0 and run by llama.cpp in a process
of its own (so its thread pool and ours never share a process), driven over a pipe: one JSON
line per call, answered when the work is done. Each call is timed on our side like every other
side, round trip included (a few hundred microseconds against calls of tenths of seconds).
llama.cpp runs with as many threads as torch, greedy argmax over its logits, extra buffer
types off (see astrai/export/llamacpp.py), and otherwise llama.cpp's defaults: K/V in float16,
flash attention on.

    python peer_llamacpp.py   # the peer process itself: reads requests on stdin
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PEER_TYPES = {"F32": "f32", "BF16": "bf16", "Q8_0": "q8_0"}  # llama.cpp's name -> export type


@dataclass(frozen=True)
class Peer:
    process: subprocess.Popen
    log: Path  # llama.cpp's stderr, shown when the peer fails
    names: tuple[str, ...]  # the calls it adds: "llama.cpp F32", ...


def export_models(folder: Path) -> dict[str, Path]:
    """folder/llama.cpp-<type>.gguf for every peer type, written when missing or older than
    the weights."""
    import astrai
    from astrai.export import save_gguf

    weights = folder / "model.safetensors"
    paths = {name: folder / f"llama.cpp-{t}.gguf" for name, t in PEER_TYPES.items()}
    stale = {
        n: p
        for n, p in paths.items()
        if not p.exists() or p.stat().st_mtime < weights.stat().st_mtime
    }
    if stale:
        params, cfg = astrai.load_pretrained(folder)
        for name, path in stale.items():
            save_gguf(path, params, cfg, None, type=PEER_TYPES[name], name=folder.name)
    return paths


def start_peer(folder: Path, threads: int, n_ctx: int) -> Peer:
    """Export the models and start the peer process; n_ctx: K/V cells per sequence."""
    paths = export_models(folder)
    log = Path(tempfile.mkstemp(prefix="llama.cpp-", suffix=".log")[1])
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    peer = Peer(process, log, tuple(f"llama.cpp {name}" for name in paths))
    paths = {k: str(v) for k, v in paths.items()}
    ask(peer, {"op": "load", "paths": paths, "n_ctx": n_ctx, "threads": threads})
    return peer


def start_for_bench(b) -> Peer:
    """The peer sized for the run's workload (the longest sequence: a decode or the prefill),
    with a note in the results saying how it runs."""
    import importlib.util

    import torch

    if importlib.util.find_spec("llama_cpp") is None:
        raise ValueError('--peer llama.cpp needs llama-cpp-python: pip install -e ".[peer]"')
    w = b.work
    length = w.prefill[1]
    n_ctx = max(w.prompt_len + w.new_tokens, length)  # per sequence
    threads = torch.get_num_threads()
    b.note(
        f"llama.cpp peer: {', '.join(PEER_TYPES)} GGUF files of the same weights, {threads} "
        "threads, its own process, extra buffer types (weight repacking, AMX) off, otherwise "
        "llama.cpp's defaults (K/V float16, flash attention on)"
    )
    return start_peer(b.folder, threads, n_ctx)


def ask(peer: Peer, request: dict) -> dict:
    peer.process.stdin.write(json.dumps(request) + "\n")
    peer.process.stdin.flush()
    line = peer.process.stdout.readline()
    if not line:
        tail = peer.log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the llama.cpp peer died (exit {peer.process.poll()}): {tail}")
    answer = json.loads(line)
    if "error" in answer:
        raise RuntimeError(f"llama.cpp peer: {answer['error']}")
    return answer


def close_peer(peer: Peer) -> None:
    if peer.process.poll() is None:
        peer.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
        peer.process.stdin.close()
        peer.process.wait(timeout=30)
    peer.log.unlink(missing_ok=True)


def generate_calls(peer: Peer | None, n: int) -> dict:
    """{"llama.cpp F32": prompts -> n greedy tokens each, ...}, all prompts in one batch."""
    if peer is None:
        return {}
    return {
        name: lambda prompts, name=name: ask(
            peer, {"op": "greedy", "model": name.split()[-1], "prompts": prompts, "n": n}
        )["tokens"]
        for name in peer.names
    }


def prefill_calls(peer: Peer | None) -> dict:
    """{"llama.cpp F32": tokens [B, T] -> {"next": each row's greedy next token}, ...}: the
    prefill, last logits only, and their argmax (microseconds) in the peer process."""
    if peer is None:
        return {}
    return {
        name: lambda x, name=name: ask(
            peer, {"op": "prefill", "model": name.split()[-1], "prompts": x.tolist()}
        )
        for name in peer.names
    }


# --- the peer process ----------------------------------------------------------------------------


def main() -> None:
    """Serve requests on stdin. A context is made per (type, number of sequences) on first use
    (the warm-up call), with exactly that many K/V streams: llama.cpp's graph spans every
    stream of a context, so one large context would make batch 1 pay for 64 sequences."""
    from astrai.export import llamacpp as lc

    lc.quiet_logs()
    setup, models = {}, {}

    def model(name: str, n_seq: int):
        if (name, n_seq) not in models:
            path, threads = setup["paths"][name], setup["threads"]
            models[name, n_seq] = lc.load(
                path, threads, setup["n_ctx"], n_seq, n_seq * setup["n_ctx"], exact=False
            )
        return models[name, n_seq]

    for line in sys.stdin:
        request = json.loads(line)
        try:
            match request["op"]:
                case "load":
                    setup = request
                    answer = {"ok": True}
                case "greedy":
                    m = model(request["model"], len(request["prompts"]))
                    answer = {"tokens": lc.greedy(m, request["prompts"], request["n"])}
                case "prefill":
                    m = model(request["model"], len(request["prompts"]))
                    answer = {"next": lc.prompt_logits(m, request["prompts"]).argmax(-1).tolist()}
                case "quit":
                    break
        except Exception as exc:  # the parent reports it; the peer stays up for the next call
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    for m in models.values():
        lc.close(m)


if __name__ == "__main__":
    main()
