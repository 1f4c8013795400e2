"""Speculative decoding of one request, as a plain loop over the pieces: a proposer (prompt
lookup or a draft model), `verify_forward`, acceptance and `discard_after`. The engine will
run the same steps batched; this loop is what its tests and the speculation benchmark compare
against plain decoding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from astrai.config import ModelConfig
from astrai.infer.acceptance import verify_sampled
from astrai.infer.draft import DraftState, draft_propose, draft_release, draft_rollback
from astrai.infer.lookup import LookupIndex, extend_lookup, propose_lookup
from astrai.infer.paged import Params, prefill
from astrai.infer.pages import Pool, alloc_pages, free_pages, page_size_of, pages_for
from astrai.infer.proposal import Proposal
from astrai.infer.sampling import SamplingParams
from astrai.infer.speculative import discard_after, verify_forward

Proposer = LookupIndex | DraftState | None


class SpecStats(NamedTuple):
    steps: int  # verification forwards
    proposed: int  # proposed tokens verified
    accepted: int  # of those, kept


def _propose(proposer, rid, tokens, k, sp, draft_generator) -> tuple[Proposer, Proposal]:
    match proposer:
        case LookupIndex():
            return proposer, Proposal(propose_lookup(proposer, k))
        case DraftState():
            return draft_propose(proposer, rid, tokens, k, sp, draft_generator)
        case None:
            return proposer, Proposal([])
    raise TypeError(f"proposer: expected a LookupIndex, a DraftState or None, got {proposer!r}")


def _grow(pool: Pool, pages: list[int], positions: int) -> tuple[Pool, list[int]]:
    need = pages_for(positions, page_size_of(pool)) - len(pages)
    if need > 0:
        pool, new = alloc_pages(pool, need)
        if new is None:
            raise ValueError(f"pool: {need} more pages needed, fewer are free")
        pages = pages + new
    return pool, pages


def speculative_generate(
    params: Params,
    cfg: ModelConfig,
    pool: Pool,
    prompt: list[int],
    max_tokens: int,
    proposer: Proposer,
    k: int = 4,
    sp: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    draft_generator: torch.Generator | None = None,
    rid: str = "0",
) -> tuple[list[int], SpecStats, Pool, Proposer]:
    """max_tokens tokens after `prompt` (no stop tokens), speculating k at a time.

    proposer: a LookupIndex over the prompt (init_lookup(prompt)), a DraftState, or None
    (plain decoding, one token per forward). sp None is greedy. Returns (tokens, stats, pool,
    proposer); pool and proposer are donated, and every page this call took is free again."""
    sp = sp or SamplingParams(temperature=0.0)
    pool, pages = _grow(pool, [], len(prompt))
    table = torch.tensor([pages])
    logits, pool = prefill(params, cfg, pool, torch.tensor([prompt]), table, 0)
    tokens = list(prompt)
    first = verify_sampled(logits, Proposal([]), sp, generator, tokens)
    tokens += first.tokens
    computed, steps, proposed, accepted = len(prompt), 0, 0, 0
    if isinstance(proposer, LookupIndex):
        proposer = extend_lookup(proposer, first.tokens)
    while len(tokens) - len(prompt) < max_tokens:
        room = min(k, max_tokens - (len(tokens) - len(prompt)) - 1)
        proposer, proposal = _propose(proposer, rid, tokens, room, sp, draft_generator)
        proposal = Proposal(
            proposal.tokens[:room], None if proposal.probs is None else proposal.probs[:room]
        )
        pool, pages = _grow(pool, pages, computed + 1 + len(proposal.tokens))
        logits, pool = verify_forward(
            params, cfg, pool, [tokens[-1]], [proposal.tokens], [computed], torch.tensor([pages])
        )
        verdict = verify_sampled(
            logits[0, : len(proposal.tokens) + 1], proposal, sp, generator, tokens
        )
        before = len(tokens)
        tokens += verdict.tokens
        computed += 1 + verdict.accepted
        pool, pages = discard_after(pool, pages, computed)
        steps, proposed, accepted = (
            steps + 1,
            proposed + len(proposal.tokens),
            accepted + verdict.accepted,
        )
        match proposer:
            case LookupIndex():
                proposer = extend_lookup(proposer, verdict.tokens)
            case DraftState():
                proposer = draft_rollback(proposer, rid, before + verdict.accepted)
    if isinstance(proposer, DraftState):
        proposer = draft_release(proposer, rid)
    pool = free_pages(pool, pages)
    return tokens[len(prompt) :], SpecStats(steps, proposed, accepted), pool, proposer
