"""llama.cpp as a peer in the benchmark (`--peer llama.cpp`).

The run's weights are exported to GGUF as F32, BF16 and Q8_0, quantised from the F32 file by
llama.cpp's own quantiser to Q4_0 and Q4_K_M, and run by llama.cpp in a process
of its own (so its thread pool and ours never share a process), driven over a pipe: one JSON
line per call, answered when the work is done. Each call is timed on our side like every other
side, round trip included (a few hundred microseconds against calls of tenths of seconds).
llama.cpp runs with as many threads as torch, greedy argmax over its logits, and otherwise
llama.cpp's defaults: K/V in float16, flash attention on, extra buffer types on (its weights
repacked into its batched layouts where it has one for the type: Q4_0 on x86), except for Q8_0
on a CPU with AMX (`repacks`).

    python peer_llamacpp.py   # the peer process itself: reads requests on stdin
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# llama.cpp's name -> our GGUF export type, for the files we write ourselves
EXPORTED = {"F32": "f32", "BF16": "bf16", "Q8_0": "q8_0"}
# llama.cpp's name -> its llama_ftype, for the files llama.cpp quantises from the F32 one (as its
# llama-quantize does: Q4_K_M mixes Q4_K, Q6_K and, for rows not a multiple of 256, fallbacks)
QUANTIZED = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


@dataclass(frozen=True)
class Peer:
    process: subprocess.Popen
    log: Path  # llama.cpp's stderr, shown when the peer fails
    names: tuple[str, ...]  # the calls it adds: "llama.cpp F32", ...
    files: dict[str, Path]  # "llama.cpp F32" -> its GGUF file


def repacks(name: str) -> bool:
    """Whether llama.cpp loads file type `name` with its extra buffer types, as its own programs
    do by default: all but Q8_0 on a CPU with AMX, where the AMX buffer type crashed on Q8_0
    weights. Off, its Q4_0 ran at 0.70x at one sequence, 0.54x at 16 and 0.48x in prompts on a
    2-core AMD Zen 5 (docs/benchmarks.md, "llama.cpp as a peer")."""
    from astrai.hardware import cpu_flags

    return not (name == "Q8_0" and "amx_int8" in cpu_flags())


def gguf_path(folder: Path, name: str) -> Path:
    return folder / f"llama.cpp-{name.lower()}.gguf"


def _stale(path: Path, source: Path) -> bool:
    return not path.exists() or path.stat().st_mtime < source.stat().st_mtime


def export_models(folder: Path, types: tuple[str, ...], threads: int = 0) -> dict[str, Path]:
    """folder/llama.cpp-<type>.gguf for every type asked for, written when missing or older than
    the weights: F32, BF16 and Q8_0 by our exporter, Q4_0 and Q4_K_M by llama.cpp's quantiser
    from the F32 file."""
    import astrai
    from astrai.export import save_gguf

    unknown = sorted(set(types) - set(EXPORTED) - set(QUANTIZED))
    if unknown:
        known = ", ".join([*EXPORTED, *QUANTIZED])
        raise ValueError(f"llama.cpp file types {unknown}; choose from {known}")
    weights = folder / "model.safetensors"
    paths = {name: gguf_path(folder, name) for name in types}
    exported = [n for n in EXPORTED if (n in types or (n == "F32" and set(types) & set(QUANTIZED)))]
    stale = [n for n in exported if _stale(gguf_path(folder, n), weights)]
    if stale:
        params, cfg = astrai.load_pretrained(folder)
        for name in stale:
            save_gguf(
                gguf_path(folder, name), params, cfg, None, type=EXPORTED[name], name=folder.name
            )
    source = gguf_path(folder, "F32")
    for name in (n for n in types if n in QUANTIZED):
        if _stale(paths[name], source):
            quantize_gguf(source, paths[name], name, threads)
    return paths


def quantize_gguf(source: Path, out: Path, name: str, threads: int = 0) -> None:
    """llama.cpp's quantiser (llama_model_quantize, what llama-quantize runs) from source to
    out in type `name` (a key of QUANTIZED); the file appears whole or not at all."""
    import ctypes

    from astrai.export.llamacpp import _llama_cpp, quiet_logs

    lib = _llama_cpp()
    quiet_logs()  # a line per tensor otherwise
    lib.llama_backend_init()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, QUANTIZED[name])
    params.nthread = threads
    tmp = out.with_name(f".{out.name}.tmp")
    status = lib.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if status != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantise {source} to {name} (status {status})")
    tmp.rename(out)


def peer_types(device, formats: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The llama.cpp files of `formats` (names of formats.FORMATS) to run here, and {type: why
    not} for the others: a file of a format whose dtype is not native here (BF16 where bf16 is
    emulated) does not run."""
    from .formats import FORMATS, skip_reason

    run, skipped = [], {}
    for f in (f for f in FORMATS if f.name in formats):
        reason = skip_reason(f, device) if f.quantize is None else None
        for name in f.peers:
            if reason is None:
                run.append(name)
            else:
                skipped[name] = reason
    return tuple(run), skipped


def start_peer(folder: Path, threads: int, n_ctx: int, types: tuple[str, ...]) -> Peer:
    """Export the models and start the peer process; n_ctx: K/V cells per sequence."""
    from .isa import check_peer  # here: this file also runs as the peer's own script

    paths = export_models(folder, types, threads)
    log = Path(tempfile.mkstemp(prefix="llama.cpp-", suffix=".log")[1])
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    files = {f"llama.cpp {name}": path for name, path in paths.items()}
    peer = Peer(process, log, tuple(files), files)
    paths = {k: str(v) for k, v in paths.items()}
    loaded = ask(peer, {"op": "load", "paths": paths, "n_ctx": n_ctx, "threads": threads})
    try:
        check_peer(loaded["features"])
    except ValueError:
        close_peer(peer)
        raise
    return peer


def start_for_bench(b) -> Peer | None:
    """The peer sized for the run's workload (the longest sequence: a decode or the prefill),
    with a note in the results saying how it runs; None, with the reason noted, where GGUF
    cannot express the model."""
    import importlib.util

    import torch

    from astrai.export import GGUFExportError, gguf_arch

    if importlib.util.find_spec("llama_cpp") is None:
        raise ValueError('--peer llama.cpp needs llama-cpp-python: pip install -e ".[peer]"')
    try:
        gguf_arch(b.cfg)
    except GGUFExportError as exc:
        b.skip("peer", "llama.cpp", str(exc))
        return None
    w = b.work
    length = w.prefill[1]
    n_ctx = max(w.prompt_len + w.new_tokens, length)  # per sequence
    threads = torch.get_num_threads()
    types, skipped = peer_types(b.device, b.wanted_formats)
    for name, reason in skipped.items():
        b.skip("peer", f"llama.cpp {name}", reason)
    b.note(
        f"llama.cpp peer: {', '.join(types)} GGUF files of the same weights ("
        f"{', '.join(t for t in types if t in QUANTIZED) or 'none'} quantised by llama.cpp "
        f"from the F32 file), {threads} threads, its own process, llama.cpp's defaults (K/V "
        "float16, flash attention on, extra buffer types: weights repacked where it can"
        f"{'' if all(map(repacks, types)) else ', but not Q8_0 on this AMX CPU'})"
    )
    return start_peer(b.folder, threads, n_ctx, types)


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


def generate_calls(peer: Peer | None, n: int, names: tuple[str, ...] | None = None) -> dict:
    """{"llama.cpp F32": prompts -> n greedy tokens each, ...}, all prompts in one batch; only
    the files `names` where given."""
    if peer is None:
        return {}
    return {
        name: lambda prompts, name=name: ask(
            peer, {"op": "greedy", "model": name.split()[-1], "prompts": prompts, "n": n}
        )["tokens"]
        for name in peer.names
        if names is None or name in names
    }


def release(peer: Peer | None, names: tuple[str, ...]) -> None:
    """Close the peer's models of the files `names` ("llama.cpp F32", ...), freeing their
    memory; a later call loads them again."""
    if peer is not None and names:
        ask(peer, {"op": "release", "models": [name.split()[-1] for name in names]})


def prefill_calls(peer: Peer | None, names: tuple[str, ...] | None = None) -> dict:
    """{"llama.cpp F32": tokens [B, T] -> {"next": each row's greedy next token}, ...}: the
    prefill, last logits only, and their argmax (microseconds) in the peer process; only the
    files `names` where given."""
    if peer is None:
        return {}
    return {
        name: lambda x, name=name: ask(
            peer, {"op": "prefill", "model": name.split()[-1], "prompts": x.tolist()}
        )
        for name in peer.names
        if names is None or name in names
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
                path,
                threads,
                setup["n_ctx"],
                n_seq,
                n_seq * setup["n_ctx"],
                exact=False,
                repack=repacks(name),
            )
        return models[name, n_seq]

    for line in sys.stdin:
        request = json.loads(line)
        try:
            match request["op"]:
                case "load":
                    setup = request
                    answer = {"features": lc.system_info()}
                case "greedy":
                    m = model(request["model"], len(request["prompts"]))
                    answer = {"tokens": lc.greedy(m, request["prompts"], request["n"])}
                case "prefill":
                    m = model(request["model"], len(request["prompts"]))
                    answer = {"next": lc.prompt_logits(m, request["prompts"]).argmax(-1).tolist()}
                case "release":
                    for key in [k for k in models if k[0] in request["models"]]:
                        lc.close(models.pop(key))
                    answer = {"ok": True}
                case "quit":
                    break
        except Exception as exc:  # the parent reports it; the peer stays up for the next call
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    for m in models.values():
        lc.close(m)


if __name__ == "__main__":
    main()
