"""Speculative decoding inside the engine step (EngineConfig.speculative).

A step that decodes asks the proposer (prompt lookup, or a draft model with its own page
pool) for up to k next tokens of each decoding request, feeds every request's last token and
its proposal as one prefill-like chunk at the request's position (one batched forward:
speculative.verify_forward), and keeps per request what acceptance.verify_sampled keeps: for
greedy requests the longest prefix equal to the target's argmax plus one token of the target's
own, for sampled ones the tokens rejection sampling keeps. Every transform of the request's
sampling (penalties, logit bias, the grammar's mask, temperature, top-k/p, min-p) is applied
to the target's logits at each proposed position, so the output is the target's: the same
tokens for greedy requests, the same distribution for sampled ones. Log-probs are the
target's.

The caller feeds the kept tokens one at a time (`fed` before each, exactly as a decode run
does), so `computed` never counts a rejected position, and the prefix cache, which only takes
full pages of tokens[:computed], never holds a rejected token's K/V. `settle` then frees the
pages past the request's next position and rolls the draft back to the tokens that stand.

Speculation adapts (`update_rate`, `worth_verifying`): each request keeps a moving average of
the share of its proposed tokens that were kept and stops proposing for a while when it is
low, and a step verifies only when the tokens its proposals are expected to add pay for the
verify forward, which a batch of many rows with few good proposals does not. The thresholds
come from measurements; see verify_cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from astrai.config import EngineConfig, ModelConfig
from astrai.infer.acceptance import Verdict, verify_sampled
from astrai.infer.constraints import allowed_tokens
from astrai.infer.draft import (
    DraftState,
    draft_propose_batch,
    draft_release,
    draft_rollback,
    init_draft,
)
from astrai.infer.events import Logprob
from astrai.infer.lookup import LookupIndex, extend_lookup, init_lookup, propose_lookup
from astrai.infer.pages import alloc_pages, num_free_pages, pages_for
from astrai.infer.proposal import Proposal
from astrai.infer.sampling import token_logprobs
from astrai.infer.scheduler import Scheduler
from astrai.infer.sequence import Sequence, page_table
from astrai.infer.speculative import discard_after, verify_forward
from astrai.model import DTYPES, Params, load_pretrained

# Per request: the moving average of accepted / proposed starts at RATE_START and moves by
# RATE_WEIGHT of each step's share. Below RATE_FLOOR a request stops proposing for PAUSE_MIN
# steps, twice as long after each further failure, up to PAUSE_MAX, then tries again (one
# verification with nothing kept pauses it again; measured, a retry judged afresh from
# RATE_START spent three failed verifications per pause on an always-wrong proposer): alone
# in its step, a row proposing k tokens pays verify_cost(k) = 0.3 + 0.1 k (0.7 at k = 4) and
# gains rate x k, a loss below about 0.2.
RATE_START = 0.5
RATE_WEIGHT = 0.3
RATE_FLOOR = 0.2
PAUSE_MIN = 4
PAUSE_MAX = 64


@dataclass(eq=False)
class RowSpec:
    """One request's speculation: its lookup index over its tokens (prompt lookup only), the
    moving average of its acceptance, and how long it pauses."""

    lookup: LookupIndex | None = None
    rate: float = RATE_START
    pause: int = 0  # steps left before it proposes again
    backoff: int = PAUSE_MIN  # the next pause


@dataclass(eq=False)
class Speculator:
    kind: str  # "lookup" or "draft"
    k: int
    ngram: int
    draft: DraftState | None = None
    rows: dict[str, RowSpec] = field(default_factory=dict)  # by request id


def init_speculator(config: EngineConfig, cfg: ModelConfig) -> Speculator | None:
    """The speculator of an engine with resolved `config`; None when it does not speculate.
    A draft model is read from `config.draft_model`, in the engine's dtype and device."""
    if config.speculative is None:
        return None
    spec = Speculator(config.speculative, config.speculative_k, config.lookup_ngram)
    if config.speculative == "draft":
        params, draft_cfg = load_pretrained(config.draft_model, DTYPES[config.dtype], config.device)
        try:
            check_draft_config(draft_cfg, cfg)
        except ValueError as exc:
            raise ValueError(f"draft_model: {exc}") from None
        dtype, pages = DTYPES[config.dtype], config.num_pages
        spec.draft = init_draft(params, draft_cfg, pages, config.page_size, dtype, config.device)
    return spec


def check_draft_config(draft: ModelConfig, target: ModelConfig) -> None:
    """A ValueError when `draft` cannot propose tokens for `target`: an encoder, or another
    vocabulary (a draft must share the target's tokenizer)."""
    if draft.model_type != "decoder":
        raise ValueError("an encoder cannot draft tokens")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"its vocabulary has {draft.vocab_size} tokens, the model's {target.vocab_size};"
            " a draft must share the model's tokenizer"
        )


def forget(spec: Speculator, rid: str) -> Speculator:
    """The request has ended: drop its index and give back its draft pages."""
    spec.rows.pop(rid, None)
    if spec.draft is not None:
        spec.draft = draft_release(spec.draft, rid)
    return spec


def verify_cost(longest: int) -> float:
    """What a verify forward over 1 + `longest` positions per row costs beyond a decode step,
    as a share of the decode step.

    Measured on a 2-core AMD EPYC shared with other work (so rounded; float32, one
    thread, a 512-wide 8-layer model with a 32k vocabulary at 200 tokens of context;
    `verify_forward` against `decode_step` on the same pool, best of 2 alternating rounds of 5),
    the verify forward over 1 + k positions took, against a decode step: k=1 1.1-2.0x, k=2
    1.1-2.3x, k=4 1.6-1.85x, at 1, 4, 8, 16 and 32 rows alike (the products stay bound by
    reading the weights; the logits of every position add the rest). So about 0.3 + 0.1 k
    beyond the step, whatever the batch."""
    return 0.3 + 0.1 * longest


def worth_verifying(spec: Speculator, seqs: list[Sequence], proposals: list[Proposal]) -> bool:
    """Whether the tokens the proposals are expected to add (each row's moving acceptance
    times its proposal's length) pay for the verify forward: a step of B rows gives B tokens
    without speculation, so the gain must exceed B x verify_cost. A large batch in which few
    rows propose decodes plainly; at 16 rows a proposal of 4 needs about 11 expected tokens."""
    longest = max(len(p.tokens) for p in proposals)
    gain = sum(spec.rows[seq.id].rate * len(p.tokens) for seq, p in zip(seqs, proposals))
    return longest > 0 and gain > len(seqs) * verify_cost(longest)


def update_rate(row: RowSpec, proposed: int, accepted: int) -> RowSpec:
    """Fold one verification into the row's moving average; pause a row below the floor."""
    if proposed == 0:
        return row
    row.rate += RATE_WEIGHT * (accepted / proposed - row.rate)
    if row.rate >= RATE_START:  # recovered: the next failure pauses briefly again
        row.backoff = PAUSE_MIN
    elif row.rate < RATE_FLOOR:
        row.pause, row.backoff = row.backoff, min(2 * row.backoff, PAUSE_MAX)
        row.rate = RATE_FLOOR  # the retry starts at the floor: one more failure pauses again
    return row


def _room(seq: Sequence, k: int) -> int:
    """Tokens seq may propose: k, less near max_tokens (the last token is the target's)."""
    if seq.max_len <= 0:
        return k
    return max(0, min(k, seq.max_len - len(seq.tokens) - 1))


def _lookup(spec: Speculator, row: RowSpec, seq: Sequence, room: int) -> Proposal:
    if row.lookup is None:
        row.lookup = init_lookup(seq.tokens, min(2, spec.ngram), spec.ngram)
    else:  # the index follows the request's tokens, which only grow
        row.lookup = extend_lookup(row.lookup, seq.tokens[len(row.lookup.tokens) :])
    return Proposal(propose_lookup(row.lookup, room))


def _trim(proposal: Proposal, n: int) -> Proposal:
    tokens, probs = proposal
    return Proposal(tokens[:n], None if probs is None else probs[:n])


def _grammar_trim(seq: Sequence, proposal: Proposal) -> Proposal:
    """The proposal up to the first token the request's grammar refuses."""
    if seq.matcher is None or not proposal.tokens:
        return proposal
    return _trim(proposal, seq.matcher.validate_tokens(proposal.tokens))


def propose(spec: Speculator, seqs: list[Sequence]) -> tuple[Speculator, list[Proposal]]:
    """Each decoding sequence's proposal (empty for a paused row, or one with no room);
    all empty when they are not worth verifying (see worth_verifying)."""
    k = spec.k
    rooms = []
    for seq in seqs:
        row = spec.rows.setdefault(seq.id, RowSpec())
        if row.pause > 0:
            row.pause -= 1
            rooms.append(0)
        else:
            rooms.append(_room(seq, k))
    proposals = [Proposal([])] * len(seqs)
    asking = [i for i, room in enumerate(rooms) if room > 0]
    if spec.kind == "lookup":
        for i in asking:
            proposals[i] = _lookup(spec, spec.rows[seqs[i].id], seqs[i], rooms[i])
    elif asking:
        spec.draft, drafted = draft_propose_batch(
            spec.draft,
            [seqs[i].id for i in asking],
            [seqs[i].tokens for i in asking],
            max(rooms[i] for i in asking),
            [seqs[i].sampling for i in asking],
            [seqs[i].generator for i in asking],
        )
        for i, proposal in zip(asking, drafted):
            proposals[i] = _trim(proposal, rooms[i])
    proposals = [_grammar_trim(seq, p) for seq, p in zip(seqs, proposals)]
    if not worth_verifying(spec, seqs, proposals):
        if spec.draft is not None:  # the draft fed its own guesses: only the request's stand
            for i in asking:
                spec.draft = draft_rollback(spec.draft, seqs[i].id, len(seqs[i].tokens))
        return spec, [Proposal([])] * len(seqs)
    return spec, proposals


def reserve(
    s: Scheduler, seqs: list[Sequence], proposals: list[Proposal]
) -> tuple[Scheduler, list[Proposal]]:
    """Pages for every row's proposed positions, from the free pages only (speculation never
    evicts the prefix cache or preempts anyone): a row they do not cover proposes only what
    its pages hold already."""
    ps = s.config.page_size
    out = []
    for seq, proposal in zip(seqs, proposals):
        need = pages_for(seq.computed + 1 + len(proposal.tokens), ps) - len(seq.pages)
        if 0 < need <= num_free_pages(s.pool):
            s.pool, pages = alloc_pages(s.pool, need)
            seq.pages += pages
        elif need > 0:
            proposal = _trim(proposal, len(seq.pages) * ps - seq.computed - 1)
        out.append(proposal)
    return s, out


def _masks(seq: Sequence, proposed: list[int], vocab: int, device) -> torch.Tensor | None:
    """The grammar's mask [len(proposed) + 1, vocab] after each prefix of the proposal."""
    if seq.matcher is None:
        return None
    matcher, rows = seq.matcher.deep_copy(), []
    for token in [None, *proposed]:
        if token is not None:
            matcher.consume_token(token)
        rows.append(allowed_tokens([matcher], vocab, device))
    return torch.cat(rows)


def _logprobs(logits: torch.Tensor, verdict: Verdict, seq: Sequence) -> list[Logprob | None]:
    """The target's log-probs of the kept tokens (logits row j gave token j)."""
    sp = seq.sampling
    if not sp.logprobs:
        return [None] * len(verdict.tokens)
    ids = torch.tensor(verdict.tokens, device=logits.device)
    chosen, top_ids, top_lp = token_logprobs(logits[: len(ids)], ids, sp.top_logprobs)
    chosen, top_ids, top_lp = chosen.tolist(), top_ids.tolist(), top_lp.tolist()
    return [
        Logprob(token, chosen[j], list(zip(top_ids[j], top_lp[j])))
        for j, token in enumerate(verdict.tokens)
    ]


def verify(
    s: Scheduler,
    spec: Speculator,
    params: Params,
    cfg: ModelConfig,
    seqs: list[Sequence],
    proposals: list[Proposal],
    lora: dict | None = None,
) -> tuple[Scheduler, Speculator, list[list[tuple[int, Logprob | None]]], tuple]:
    """One forward over every row's last token and proposal (with each row's adapter, `lora`
    as `prefill` takes it) -> each row's kept tokens with their log-probs, and the counts (rows
    with a proposal, tokens proposed, tokens kept). The rows' pages must cover the proposals
    (see `reserve`); `computed` is left to the caller, which feeds the kept tokens."""
    logits, s.pool = verify_forward(
        params,
        cfg,
        s.pool,
        [seq.tokens[-1] for seq in seqs],
        [p.tokens for p in proposals],
        [seq.computed for seq in seqs],
        page_table(seqs, s.pool["k"].device),
        lora,
    )
    kept, counts = [], [0, 0, 0]
    for b, (seq, proposal) in enumerate(zip(seqs, proposals)):
        n = len(proposal.tokens)
        rows = logits[b, : n + 1]
        allowed = _masks(seq, proposal.tokens, rows.shape[-1], rows.device)
        verdict = verify_sampled(rows, proposal, seq.sampling, seq.generator, seq.tokens, allowed)
        spec.rows[seq.id] = update_rate(spec.rows[seq.id], n, verdict.accepted)
        kept.append(list(zip(verdict.tokens, _logprobs(rows, verdict, seq))))
        counts = [counts[0] + (n > 0), counts[1] + n, counts[2] + verdict.accepted]
    return s, spec, kept, tuple(counts)


def settle(s: Scheduler, spec: Speculator, seq: Sequence) -> tuple[Scheduler, Speculator]:
    """After seq took its kept tokens (and still runs): free its pages past the one holding
    its last fed token, whose K/V belonged to rejected tokens (the page the next token goes
    to is found by the next step's plan), and roll the draft back to the tokens that stand
    (all but the last, which neither model has fed yet)."""
    s.pool, seq.pages = discard_after(s.pool, seq.pages, seq.computed)
    if spec.draft is not None:
        spec.draft = draft_rollback(spec.draft, seq.id, len(seq.tokens) - 1)
    return s, spec
