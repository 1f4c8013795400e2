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
    state, proposals = draft_propose_batch(state, [rid], [tokens], k, [sp], [generator])
    return state, proposals[0]


def draft_propose_batch(
    state: DraftState,
    rids: list[str],
    token_lists: list[list[int]],
    k: int,
    settings: list[SamplingParams | None] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> tuple[DraftState, list[Proposal]]:
    """`draft_propose` for a batch of requests: one prefill chunk that catches every request
    up, then k - 1 batched decode steps. All get k tokens; a request near the model's last
    position gets fewer (and drops out of the steps past it, the others going on), one at it
    or one the pool has no room for an empty proposal."""
    B = len(rids)
    settings, generators = settings or [None] * B, generators or [None] * B
    if any(not tokens for tokens in token_lists):
        raise ValueError("draft_propose: tokens must hold at least the prompt's first token")
    limit = state.cfg.max_position_embeddings
    ks = [min(k, limit - len(tokens)) for tokens in token_lists]
    proposals = [Proposal([])] * B
    rows = [
        b for b in range(B) if ks[b] > 0 and _grow(state, rids[b], len(token_lists[b]) + ks[b] - 1)
    ]
    if not rows:
        return state, proposals
    tokens = [token_lists[b] for b in rows]
    pages = [state.pages[rids[b]] for b in rows]
    # at least the last token is fed: its logits give the first draft token
    done = [min(state.computed.get(rids[b], 0), len(t) - 1) for b, t in zip(rows, tokens)]
    device = state.pool["k"].device
    width = max(len(p) for p in pages)  # entries past a row's pages are never read
    table = torch.tensor([p + [p[0]] * (width - len(p)) for p in pages], device=device)
    chunks = [t[d:] for t, d in zip(tokens, done)]
    T = max(len(c) for c in chunks)
    padded = torch.tensor([c + [0] * (T - len(c)) for c in chunks], device=device)
    lengths = torch.tensor([len(c) for c in chunks], device=device)
    start = torch.tensor(done, device=device)
    logits, state.pool = prefill(state.params, state.cfg, state.pool, padded, table, start, lengths)
    drafted, qs = [[] for _ in rows], [[] for _ in rows]
    wants = [ks[b] for b in rows]
    active = list(range(len(rows)))  # the rows `logits` belong to, in order
    for i in range(max(wants)):
        for at, j in enumerate(active):
            b = rows[j]
            token, q = _pick(logits[at], settings[b], generators[b], tokens[j] + drafted[j])
            drafted[j].append(token)
            qs[j].append(q)
        active = [j for j in active if wants[j] > i + 1]  # a row stops at its last position
        if active:
            step = torch.tensor([drafted[j][-1] for j in active], device=device)
            positions = torch.tensor([len(tokens[j]) + i for j in active], device=device)
            logits, state.pool = decode_step(
                state.params, state.cfg, state.pool, step, positions, table[active]
            )
    for j, b in enumerate(rows):
        state.computed[rids[b]] = len(tokens[j]) + wants[j] - 1
        probs = None if qs[j][0] is None else torch.stack(qs[j])
        proposals[b] = Proposal(drafted[j], probs)
    return state, proposals


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
