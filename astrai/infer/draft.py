"""A draft model as a proposer: a smaller model with the same tokenizer guesses k tokens by
ordinary paged decoding, in a page pool of its own.

The draft keeps, per request, the pages of its own K/V and how many leading tokens of the
request they hold. Proposing first feeds the tokens it has not seen (the last round's accepted
tokens and correction) as one prefill chunk, then decodes k tokens, feeding all but the last.
After verification, `draft_rollback` keeps the K/V of the tokens that stand: the request's
tokens before the proposal and the accepted proposed ones, and frees the pages past them.

A greedy request gets the draft's argmax tokens, a one-hot q. A sampled one gets tokens drawn
with the request's own transforms (temperature, top-k, top-p, penalties) from the draft's
logits, with the draft's own generator, and their distributions as q: any q keeps the
verified output exact, and one close to the target's is accepted more often.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from astrai.config import ModelConfig
from astrai.infer.acceptance import request_logits, request_probs
from astrai.infer.paged import Params, decode_step, prefill
from astrai.infer.pages import Pool, alloc_pages, free_pages, init_pages, pages_for
from astrai.infer.proposal import Proposal
from astrai.infer.sampling import SamplingParams, argmax_rows, draw
from astrai.infer.speculative import discard_after


@dataclass(eq=False)
class DraftState:
    params: Params
    cfg: ModelConfig
    pool: Pool
    page_size: int
    pages: dict[str, list[int]] = field(default_factory=dict)  # request id -> its pages
    computed: dict[str, int] = field(default_factory=dict)  # leading tokens in those pages


def init_draft(
    params: Params,
    cfg: ModelConfig,
    num_pages: int,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> DraftState:
    """A draft model with an empty pool of its own."""
    return DraftState(params, cfg, init_pages(cfg, num_pages, page_size, dtype, device), page_size)


def _grow(state: DraftState, rid: str, positions: int) -> bool:
    """Pages for the request's first `positions` positions; False when the pool is short."""
    pages = state.pages.setdefault(rid, [])
    need = pages_for(positions, state.page_size) - len(pages)
    if need > 0:
        state.pool, new = alloc_pages(state.pool, need)
        if new is None:
            return False
        pages += new
    return True


def _pick(logits, sp, generator, history) -> tuple[int, torch.Tensor | None]:
    """The draft's token from its logits [vocab], and the distribution it came from (None
    when chosen greedily)."""
    if sp is None or sp.temperature == 0:
        adjusted = logits[None] if sp is None else request_logits(logits[None], sp, history)
        return int(argmax_rows(adjusted)), None
    probs = request_probs(request_logits(logits[None], sp, history), sp)
    token = int(draw(probs, [generator]))
    return token, (probs / probs.sum(-1, keepdim=True))[0]


def draft_propose(
    state: DraftState,
    rid: str,
    tokens: list[int],
    k: int,
    sp: SamplingParams | None = None,
    generator: torch.Generator | None = None,
) -> tuple[DraftState, Proposal]:
    """Propose k tokens to follow the request's `tokens` (prompt and accepted output).

    sp None or at temperature 0: greedy draft tokens, Proposal.probs None; otherwise drawn
    with sp's transforms and `generator`. An empty proposal when the draft's pool has no room
    or the model's positions run out. The state is donated."""
    if not tokens:
        raise ValueError("draft_propose: tokens must hold at least the prompt's first token")
    k = min(k, state.cfg.max_position_embeddings - len(tokens))
    if k <= 0 or not _grow(state, rid, len(tokens) + k - 1):
        return state, Proposal([])
    # at least the last token is fed: its logits give the first draft token
    done = min(state.computed.get(rid, 0), len(tokens) - 1)
    table = torch.tensor([state.pages[rid]], device=state.pool["k"].device)
    chunk = torch.tensor([tokens[done:]], device=table.device)
    logits, state.pool = prefill(state.params, state.cfg, state.pool, chunk, table, done)
    drafted, rows = [], []
    for i in range(k):
        token, q = _pick(logits[0], sp, generator, tokens + drafted)
        drafted.append(token)
        rows.append(q)
        if i < k - 1:
            position = torch.tensor([len(tokens) + i], device=table.device)
            step = torch.tensor([token], device=table.device)
            logits, state.pool = decode_step(
                state.params, state.cfg, state.pool, step, position, table
            )
    state.computed[rid] = len(tokens) + k - 1
    probs = None if rows[0] is None else torch.stack(rows)
    return state, Proposal(drafted, probs)


def draft_rollback(state: DraftState, rid: str, keep: int) -> DraftState:
    """The request's first `keep` tokens stand (its tokens before the proposal plus the
    accepted ones): the draft's K/V past them are dropped and whole pages freed. Donated."""
    keep = min(keep, state.computed.get(rid, 0))
    state.pool, state.pages[rid] = discard_after(state.pool, state.pages.get(rid, []), keep)
    state.computed[rid] = keep
    return state


def draft_release(state: DraftState, rid: str) -> DraftState:
    """The request is done: all its draft pages go back to the pool. Donated."""
    pages = state.pages.pop(rid, [])
    state.computed.pop(rid, None)
    if pages:
        state.pool = free_pages(state.pool, pages)
    return state
