"""llama.cpp's speculative decoding beside ours, in the speculation section (`--peer llama.cpp`).

llama-cpp-python's `Llama.generate` speculates with any `LlamaDraftModel` given as
`draft_model=`: a callable from the tokens so far to proposed next tokens. It evaluates the
last token and the proposal in one batch, keeps the proposed tokens its sampler agrees with,
and drops the K/V of the rest. The binding brings prompt lookup
(`LlamaPromptLookupDecoding`); a draft model is `GreedyDraft` below, a second `Llama` on the
GGUF of our distilled draft that decodes k greedy tokens and keeps its K/V of the tokens it
shares with the target's.

Three llama.cpp sides run on the F32 files of the section's own target and draft (the same
weights, the same bits as our float32), each in a process of its own, batch 1, greedy:
"llama.cpp plain", "llama.cpp lookup" and "llama.cpp draft", with llama.cpp's defaults (K/V in
float16, so its greedy tokens may part from ours where two logits nearly tie) and flash
attention on. Our speculating Engines run again in the same rounds, so that every ratio compares
sides measured together:

- llama.cpp lookup vs llama.cpp plain on grounded traffic, llama.cpp draft vs llama.cpp plain
  on chat-like traffic: what speculation gains llama.cpp;
- ours vs llama.cpp with the same kind of speculation on each: the absolute comparison.

What the binding lets us set and what it does not: lookup proposes k tokens (num_pred_tokens)
after the longest suffix n-gram up to the Engine's lookup_ngram (max_ngram_size), but tries
n-grams down to 1 token where ours stops at 2, and takes the earliest occurrence where ours
takes the latest. The draft proposes exactly k tokens, as ours does.

    python spec_peer.py SPEC_JSON   # a llama.cpp side: the protocol of side_worker.py
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

SIDES = ("plain", "lookup", "draft")  # llama.cpp's, named "llama.cpp <kind>"


def leading(a, b) -> int:
    """How many leading tokens two sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def kept_tokens(proposals: list[tuple[int, list[int]]], sequence: list[int]) -> tuple[int, int]:
    """(proposed, kept) over proposals of (position of the first proposed token, tokens) for a
    final greedy sequence (prompt and output): a proposed token is kept when it and those
    before it in its proposal are the tokens greedy decoding chose. Tokens proposed past the
    sequence's end were never checked and are left out of both."""
    proposed = kept = 0
    for position, tokens in proposals:
        checked = tokens[: max(0, len(sequence) - position)]
        proposed += len(checked)
        kept += leading(checked, sequence[position:])
    return proposed, kept


# --- a llama.cpp side, in its own process ---------------------------------------------------------


def _draft_class():
    from llama_cpp.llama_speculative import LlamaDraftModel

    class GreedyDraft(LlamaDraftModel):
        """k greedy tokens of a second Llama. Its K/V of the leading tokens it shares with the
        target's sequence stay; the rest (a rejected proposal) is dropped and the new tokens fed
        in one batch, as llama.cpp's own speculative decoding does with its draft."""

        def __init__(self, draft, k: int):
            self.draft, self.k = draft, k

        def __call__(self, input_ids, /, **kwargs):
            import llama_cpp
            import numpy as np

            d, ids = self.draft, input_ids.tolist()
            # feed at least the last token: its logits give the first proposed token
            d.n_tokens = min(leading(d.input_ids[: d.n_tokens].tolist(), ids), len(ids) - 1)
            d.eval(ids[d.n_tokens :])  # drops the K/V from n_tokens on first
            out = []
            for i in range(self.k):
                logits = llama_cpp.llama_get_logits_ith(d.ctx, -1)
                out.append(int(np.ctypeslib.as_array(logits, shape=(d.n_vocab(),)).argmax()))
                if i < self.k - 1:
                    d.eval(out[-1:])
            return np.array(out, dtype=np.intc)

    return GreedyDraft


def _recording(proposer, proposals: list):
    """proposer, with each proposal appended to proposals as (its first position, tokens)."""
    from llama_cpp.llama_speculative import LlamaDraftModel

    class Recording(LlamaDraftModel):
        def __call__(self, input_ids, /, **kwargs):
            tokens = proposer(input_ids, **kwargs)
            proposals.append((len(input_ids), [int(t) for t in tokens]))
            return tokens

    return Recording()


_QUIET = []  # the ctypes callback must outlive every call into llama.cpp


def _quiet_logs() -> None:
    """llama.cpp's log lines go nowhere. As astrai.export.llamacpp.quiet_logs, without
    importing astrai (and torch): a side process starts in a second, not in several."""
    import ctypes

    import llama_cpp

    if not _QUIET:
        _QUIET.append(llama_cpp.llama_log_callback(lambda level, text, user_data: None))
        llama_cpp.llama_log_set(_QUIET[0], ctypes.c_void_p(0))


def load_llamacpp_side(spec: dict):
    """(every Llama loaded, the target's first; the list its proposals are recorded in) for a
    side's spec: "kind"
    (plain, lookup, draft), "model" and "draft" (GGUF paths), "k", "ngram", "threads",
    "n_ctx"."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    _quiet_logs()
    common = {
        "n_ctx": spec["n_ctx"],
        "n_threads": spec["threads"],
        "n_threads_batch": spec["threads"],
        "flash_attn": True,  # as llama.cpp's default context (flash attention "auto") runs
        "verbose": False,
    }
    proposals: list = []
    helpers = []
    match spec["kind"]:
        case "plain":
            proposer = None
        case "lookup":
            proposer = LlamaPromptLookupDecoding(spec["ngram"], spec["k"])
        case "draft":
            helpers.append(Llama(spec["draft"], **common))
            proposer = _draft_class()(helpers[0], spec["k"])
        case other:
            raise ValueError(f"kind: plain, lookup or draft, got {other!r}")
    draft_model = None if proposer is None else _recording(proposer, proposals)
    return [Llama(spec["model"], draft_model=draft_model, **common), *helpers], proposals


def generate_one(llm, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt, from an empty K/V (no prefix kept from the last request)."""
    llm.reset()
    out: list[int] = []
    for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) == n:
            return out
    raise RuntimeError(f"llama.cpp stopped after {len(out)} of {n} tokens")


def serve_side(spec: dict) -> None:
    """Answer request lines as side_worker.py does, with the cumulative speculative counts
    (spec_steps: verifications, spec_proposed and spec_accepted: tokens)."""
    llms, proposals = load_llamacpp_side(spec)
    llm = llms[0]
    counts = {"spec_steps": 0, "spec_proposed": 0, "spec_accepted": 0}
    print(json.dumps({"ready": True, "facts": {}}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        tokens = []
        for prompt in request["prompts"]:
            proposals.clear()
            tokens.append(generate_one(llm, prompt, request["new_tokens"]))
            # every proposal (none after the last token) was checked by one forward; after an
            # empty one that forward is a plain decode step, not a verification
            proposed, kept = kept_tokens(proposals, prompt + tokens[-1])
            counts["spec_steps"] += sum(1 for _, proposal in proposals if proposal)
            counts["spec_proposed"] += proposed
            counts["spec_accepted"] += kept
        print(json.dumps({"tokens": tokens, "counts": counts}), flush=True)
    for m in llms:  # before the interpreter's exit, which the binding's finalisers trip over
        m.close()


# --- the benchmark's side -------------------------------------------------------------------------


@contextlib.contextmanager
def llamacpp_side(spec: dict) -> Iterator:
    """A llama.cpp side in a process of its own, as isolated.SideProcess."""
    from .isolated import SideProcess, _answer

    command = [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield SideProcess(process, _answer(process)["facts"])
    finally:
        process.stdin.close()
        process.wait(timeout=60)


def llamacpp_specs(target: Path, draft: Path, k: int, ngram: int, threads: int, n_ctx: int):
    """{"llama.cpp plain": spec, ...} on the F32 GGUF files of target and draft (exported
    next to their weights when missing or older)."""
    from .peer_llamacpp import export_models

    model, draft_model = (export_models(folder, ("F32",))["F32"] for folder in (target, draft))
    base = {"model": str(model), "draft": str(draft_model), "k": k, "ngram": ngram}
    base |= {"threads": threads, "n_ctx": n_ctx}
    return {f"llama.cpp {kind}": {**base, "kind": kind} for kind in SIDES}


def speculation_figures(counts: dict) -> str:
    """A side's acceptance rate and tokens per verification, in words, from its counts."""
    steps, proposed, kept = (counts.get(f"spec_{c}", 0) for c in ("steps", "proposed", "accepted"))
    acceptance = kept / proposed if proposed else 0.0
    per_step = (steps + kept) / steps if steps else 1.0
    return f"acceptance {acceptance:.2f}, {per_step:.2f} tokens/verification"


def peer_row(b, label: str, pair: tuple[str, str], measured, batches) -> dict:
    """pair[0] against pair[1] measured in the same rounds, with its greedy agreement: a
    llama.cpp side's rounding cannot be reproduced here, so sides that part are "unchecked"."""
    from .report import compare
    from .verify import generated, verdict

    rates, outputs, counts = measured
    first, second = pair
    name = f"{label} ({first}: {speculation_figures(counts[first])})"
    row = compare("speculation", name, "tok/s", rates[first], rates[second], second)
    choices = tuple(
        [
            generated(prompt, out)
            for r, outs in sorted(outputs[side].items())
            for prompt, out in zip(batches[r + 1], outs)
        ]
        for side in pair
    )
    row |= verdict(pair, choices, exact=None, rounded=(None, None))
    row |= {"sides": list(pair), "counts": {side: counts[side] for side in pair}}
    b.log(f"speculation: {name}: {row['ratio']:.2f}x, agreement {row['agreement']:.2f}")
    return row


def _rounds_of(prompts: list[list[int]], rounds: int, per_round: int) -> list[list[list[int]]]:
    return [prompts[r * per_round : (r + 1) * per_round] for r in range(rounds)]


def peer_speculation(b, specs: dict, per_round: int) -> None:
    """With `--peer llama.cpp`: llama.cpp's lookup and draft rows beside ours (module
    docstring). specs: the section's Engine specs ("lookup", "draft"), whose target, draft,
    k, workload and lookup n-gram the llama.cpp sides take; per_round: batch-1 requests per
    round. The prompts are the section's batch-1 grounded and chat-like ones (the same seeds)."""
    if b.peer is None:
        return
    import torch

    from astrai.config import EngineConfig

    from .isolated import side_process
    from .spec_models import chat_prompts, grounded_prompts
    from .speculating import rates_and_counts

    lookup, draft = specs["lookup"], specs["draft"]
    n, k = lookup["workload"]["new_tokens"], lookup["settings"]["speculative_k"]
    ngram = lookup["settings"].get("lookup_ngram", EngineConfig().lookup_ngram)
    rounds = b.work.rounds + 1
    cases = {  # kind of speculation -> (prompts, traffic)
        "lookup": (grounded_prompts(rounds * per_round, n), "grounded"),
        "draft": (chat_prompts(rounds * per_round, 32), "chat-like"),
    }
    longest = max(len(p) for prompts, _ in cases.values() for p in prompts)
    threads = torch.get_num_threads()
    target, draft_folder = Path(lookup["folder"]), Path(draft["settings"]["draft_model"])
    # K/V cells: the longest prompt, its output, and a proposal checked past the last token
    peers = llamacpp_specs(target, draft_folder, k, ngram, threads, longest + n + k + 1)
    b.note(
        f"speculation with llama.cpp: llama-cpp-python's Llama.generate on the F32 files of the "
        f"section's target and draft, {threads} threads, each side its own process, batch 1, "
        f"greedy; lookup: LlamaPromptLookupDecoding(max_ngram_size={ngram}, "
        f"num_pred_tokens={k}) (n-grams down to 1, earliest match; ours: down to 2, latest); "
        f"draft: the draft's GGUF decoding {k} greedy tokens; K/V in float16 (llama.cpp's "
        "default), flash attention on; the binding does not expose extra buffer types, which "
        "take no tensor of an F32 file (llama.cpp's load log: they cannot use CPU_REPACK)"
    )
    with contextlib.ExitStack() as stack:
        processes = {name: stack.enter_context(llamacpp_side(spec)) for name, spec in peers.items()}
        for kind in cases:
            ours = f"engine {kind}"
            processes[ours] = stack.enter_context(side_process(specs[kind], threads))
        for kind, (prompts, traffic) in cases.items():
            ours, theirs = f"engine {kind}", f"llama.cpp {kind}"
            batches = _rounds_of(prompts, rounds, per_round)
            names = (ours, theirs, "llama.cpp plain")
            measured = rates_and_counts(b, processes, names, batches, n)
            label = f"{kind} k={k}, batch 1, {traffic}"
            for name, pair in (
                (f"llama.cpp {label}", (theirs, "llama.cpp plain")),  # what it gains llama.cpp
                (f"ours vs llama.cpp, {label}", (ours, theirs)),  # the absolute comparison
            ):
                b.rows.append(peer_row(b, name, pair, measured, batches))


if __name__ == "__main__":
    serve_side(json.loads(sys.argv[1]))
