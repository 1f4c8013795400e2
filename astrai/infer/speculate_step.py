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
the share of its proposed tokens that were kept, and a step verifies only when the tokens its
proposals are expected to add pay for the verify forward and, with a draft, the draft's own
steps, which a batch of many rows with few good proposals does not (in a closed batch of
rows that end only at their length, the steps they save the batch: `steps_saved`). A
prompt-lookup row whose
rate is low goes on proposing (a few dictionary lookups) without verifying: its proposal is
scored against the tokens the row then writes (`score_unverified`), so its rate follows its
traffic at no forward's cost, and it verifies again once that rate is back. A draft row, whose
proposals cost forwards, stops proposing for a while instead. New rows start from the engine's
own moving acceptance over all rows (`Speculator.prior`), so on traffic whose proposals are
rarely kept a new request does not pay failed verifications to learn it. What a verify step
costs is measured by the engine as it runs (spec_costs.py; engine_step times its steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
from astrai.infer.prepare import prepare_params
from astrai.infer.proposal import Proposal
from astrai.infer.sampling import token_logprobs
from astrai.infer.scheduler import Scheduler
from astrai.infer.sequence import Sequence, page_table
from astrai.infer.spec_costs import StepCosts, draft_cost, verify_cost, with_draft
from astrai.infer.speculative import discard_after, verify_forward
from astrai.model import DTYPES, Params, load_pretrained
from astrai.model.params import param_shapes

# Per request: the moving average of accepted / proposed starts at RATE_START and moves by
# RATE_WEIGHT of each step's share. Below RATE_FLOOR a request stops proposing for PAUSE_MIN
# steps, twice as long after each further failure, up to PAUSE_MAX, then tries again (one
# verification with nothing kept pauses it again; measured, a retry judged afresh from
# RATE_START spent three failed verifications per pause on an always-wrong proposer): alone
# in its step, a row proposing k tokens pays the prior verify cost 0.3 + 0.1 k (0.7 at k = 4;
# spec_costs.py) and gains rate x k, a loss below about 0.2.
RATE_START = 0.5
RATE_WEIGHT = 0.3
RATE_FLOOR = 0.2
# A watching lookup row verifies again only at RATE_RESUME, and a new one starts verifying
# only with the prior there: both are chosen by scored outcomes, which one lucky proposal
# lifts over the floor. Measured on misleading traffic (6 rounds of the speculation bench),
# tokens verified at 0.02-0.3 kept: batch 1 ~60 -> 4-8, 16 concurrent 180-206 -> 102. From
# the floor one wholly kept proposal brings a row to 0.44.
RATE_RESUME = 0.4
PAUSE_MIN = 4
PAUSE_MAX = 64
# The engine's prior moves by PRIOR_WEIGHT of every row's outcome: a batch-1 request of
# always-wrong proposals brings it from RATE_START below RATE_FLOOR in 7 outcomes.
PRIOR_WEIGHT = 0.1


@dataclass(eq=False)
class RowSpec:
    """One request's speculation: its lookup index over its tokens (prompt lookup only), the
    moving average of its acceptance, how long it pauses (a draft's rows), the lookup
    proposal it made without verifying (scored against what the row writes next), and
    whether it has passed the draft's last position (it proposes no more)."""

    lookup: LookupIndex | None = None
    rate: float = RATE_START
    pause: int = 0  # steps left before it proposes again
    backoff: int = PAUSE_MIN  # the next pause
    unverified: tuple[int, list[int]] | None = None  # (its position, the proposed tokens)
    past_draft: bool = False
    watching: bool = False  # a lookup row under the floor, until it reaches RATE_RESUME


@dataclass(eq=False)
class Speculator:
    kind: str  # "lookup" or "draft"
    k: int
    ngram: int
    draft: DraftState | None = None
    rows: dict[str, RowSpec] = field(default_factory=dict)  # by request id
    draft_cost: float = 0.0  # a draft step as a share of a target step (see draft_step_cost)
    prior: float = RATE_START  # the moving acceptance over every row: where new rows start
    backoff: int = PAUSE_MIN  # a draft's new row below the floor starts with this pause
    watched: int = 0  # lookup tokens proposed without verifying, scored against the rows'
    watched_kept: int = 0  # and of those, the ones the rows then wrote
    costs: StepCosts = field(default_factory=StepCosts)  # measured step costs (spec_costs.py)


def init_speculator(config: EngineConfig, cfg: ModelConfig) -> Speculator | None:
    """The speculator of an engine with resolved `config`; None when it does not speculate.
    A draft model is read from `config.draft_model`, in the engine's dtype and device, and
    prepared for decoding in float (prepare_params; its weights are few, and quantized ones
    would only propose worse): a 128-wide 4-layer draft's step took 0.90 ms unprepared, its
    layers run from Python, and 0.24 ms prepared, its layers in one C call."""
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
        params = prepare_params(params)
        spec.draft = init_draft(params, draft_cfg, pages, config.page_size, dtype, config.device)
        spec.draft_cost = draft_step_cost(draft_cfg, cfg)
    return spec


def weights_read(cfg: ModelConfig) -> int:
    """The weights a decode step reads (param_shapes'): every layer's and the output head,
    not the input embedding, which gives one row per token (unless it is the tied head).
    A mixture of experts counts every expert: a batch of rows reads most of them."""
    embedding = "model.embed_tokens.weight"
    return sum(
        math.prod(shape)
        for key, shape in param_shapes(cfg).items()
        if key != embedding or cfg.tie_word_embeddings
    )


def draft_step_cost(draft: ModelConfig, target: ModelConfig) -> float:
    """A draft decode step's cost as a share of the target's, from the weights each reads.

    Measured on a 2-core AMD EPYC shared with other work (float32, one thread, the benchmark's
    512-wide 8-layer target and its 128-wide 4-layer draft, best of 30 `decode_step` calls
    each): 0.044 at 1 row, 0.042 at 16, where the weights they read give 0.036. A decode step
    of models this size is bound by reading the weights; at toy sizes fixed per-op costs make
    the draft's share larger than this says."""
    return weights_read(draft) / weights_read(target)


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


def worth_verifying(
    spec: Speculator,
    seqs: list[Sequence],
    lengths: list[int],
    closed_batch: list[Sequence] | None = None,
) -> bool:
    """Whether the decode steps the proposals of `lengths` tokens are expected to save
    (`steps_saved`) pay for what proposing and verifying cost: verify_cost + k x draft_cost
    steps, k the longest proposal (a draft runs k steps for every row it drafts for; lookup
    costs no forward). verify_cost is what this engine measured a verify step of about this
    many rows and this k to cost beyond a plain decode step (spec_costs.py), 0.3 + 0.1 k
    until it has; a draft step's share likewise, the share of the weights each reads
    (`draft_cost`) until measured. A large batch in which few rows propose decodes plainly:
    at 16 rows a proposal of 4 needs about 11 expected tokens at the prior, 16 to 21 at the
    1.0-1.3 measured there on one thread; with a `closed_batch`, see steps_saved."""
    longest = max(lengths, default=0)
    draft = draft_cost(spec.costs, len(seqs), spec.draft_cost)  # lookup's: none measured, 0
    cost = verify_cost(spec.costs, len(seqs), longest) + longest * draft
    return longest > 0 and steps_saved(spec, seqs, lengths, closed_batch) > cost


def steps_saved(
    spec: Speculator,
    seqs: list[Sequence],
    lengths: list[int],
    closed_batch: list[Sequence] | None = None,
) -> float:
    """The batch's decode steps that verifying proposals of `lengths` tokens is expected to
    save; a row expects its moving acceptance times its proposal's length more tokens.

    In general, the tokens the rows expect over the B tokens a plain step of B rows gives:
    tokens are what a server gains (a row that ends sooner makes room for another, or answers
    sooner), and when rows end at a stop token nobody can foresee which row the batch waits
    for last. But when the batch is closed (`closed_batch`: every unfinished request, none
    waiting to join, those still feeding their prompts included) and each of its rows can
    end only at its length, the batch takes as many steps as its longest row has tokens left,
    and only the rows that decide that count: of 16 rows of equal length, 4 rows that gain 4
    tokens each save no step, while verifying them costs a step's share of all 16 (measured,
    16 concurrent random prompts: such steps, 4-6 rows of 16 expecting 3-4 tokens each, took
    the benchmark's row to 0.90-0.97x)."""
    gains = {seq.id: spec.rows[seq.id].rate * n for seq, n in zip(seqs, lengths)}
    if closed_batch is None or not all(_ends_at_length(seq) for seq in closed_batch):
        return sum(gains.values()) / len(seqs)
    left = [seq.max_len - len(seq.tokens) for seq in closed_batch]
    after = [n - gains.get(seq.id, 0.0) for seq, n in zip(closed_batch, left)]
    return max(left) - max(after)


def _ends_at_length(seq: Sequence) -> bool:
    """Whether nothing but its length can end the row: no stop token, stop string or
    grammar (text.token_text's conditions), and a length."""
    return seq.max_len > 0 and not (seq.stop_ids or seq.sampling.stop or seq.matcher)


def fold_rate(row: RowSpec, proposed: int, accepted: int) -> RowSpec:
    """The row's moving average with one more outcome."""
    row.rate += RATE_WEIGHT * (accepted / proposed - row.rate)
    return row


def fold_watched(row: RowSpec, proposed: int, accepted: int) -> RowSpec:
    """A lookup row's moving average with one more outcome, verified or scored: under the
    floor it watches, and it verifies again once back at RATE_RESUME."""
    row = fold_rate(row, proposed, accepted)
    row.watching = row.rate < (RATE_RESUME if row.watching else RATE_FLOOR)
    return row


def update_rate(row: RowSpec, proposed: int, accepted: int) -> RowSpec:
    """Fold one verification into the row's moving average; pause a row below the floor."""
    if proposed == 0:
        return row
    row = fold_rate(row, proposed, accepted)
    if row.rate >= RATE_START:  # recovered: the next failure pauses briefly again
        row.backoff = PAUSE_MIN
    elif row.rate < RATE_FLOOR:
        row.pause, row.backoff = row.backoff, min(2 * row.backoff, PAUSE_MAX)
        row.rate = RATE_FLOOR  # the retry starts at the floor: one more failure pauses again
    return row


def learn(spec: Speculator, row: RowSpec, proposed: int, accepted: int) -> Speculator:
    """Fold a row's outcome into the engine's prior, and a draft row's pause into the pause
    new rows start with (reset once a row recovers)."""
    if proposed == 0:
        return spec
    spec.prior += PRIOR_WEIGHT * (accepted / proposed - spec.prior)
    if row.pause:
        spec.backoff = max(spec.backoff, row.pause)
    elif row.rate >= RATE_START:
        spec.backoff = PAUSE_MIN
    return spec


def new_row(spec: Speculator) -> RowSpec:
    """A new request's RowSpec, at the engine's prior. A lookup row watches (proposes without
    verifying, see score_unverified) unless the prior is at RATE_RESUME, the bar a watching
    row clears (the prior is mostly scored outcomes too); below the floor a draft row starts
    with the pause the engine's rows last needed, then one try."""
    if spec.kind == "lookup":
        return RowSpec(rate=spec.prior, watching=spec.prior < RATE_RESUME)
    if spec.prior >= RATE_FLOOR:
        return RowSpec(rate=spec.prior)
    return RowSpec(rate=RATE_FLOOR, pause=spec.backoff, backoff=min(2 * spec.backoff, PAUSE_MAX))


def unverified_outcome(row: RowSpec, tokens: list[int]) -> tuple[int, int] | None:
    """(proposed, accepted) that verifying the row's unverified proposal would have given,
    from the tokens the row wrote since (`tokens`: all of them); None when there is none or
    nothing is written yet. Greedy, the target's tokens are exactly what verifying keeps;
    sampled, the chance that a written token equals the proposed one is the chance that
    rejection sampling keeps it (p of the token, for a proposer with a one-hot q)."""
    if row.unverified is None:
        return None
    at, proposed = row.unverified
    written = tokens[at : at + len(proposed)]
    if not written:
        return None
    kept = 0
    while kept < len(written) and written[kept] == proposed[kept]:
        kept += 1
    # all written ones kept: what follows is not known yet, so only those count
    return (len(written), kept) if kept == len(written) else (len(proposed), kept)


def score_unverified(spec: Speculator, row: RowSpec, seq: Sequence) -> Speculator:
    """Fold the row's unverified proposal, scored against what it wrote, into its rate."""
    outcome = unverified_outcome(row, seq.tokens)
    if outcome is not None:
        row.unverified = None
        spec.watched, spec.watched_kept = spec.watched + outcome[0], spec.watched_kept + outcome[1]
        row = fold_watched(row, *outcome)
        spec = learn(spec, row, *outcome)
    return spec


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


def _draft_room(spec: Speculator, row: RowSpec, seq: Sequence, room: int) -> int:
    """room, less near the draft's last position; a row that reaches it proposes no more
    (the others go on)."""
    if row.past_draft or room == 0:
        return 0
    room = min(room, spec.draft.cfg.max_position_embeddings - len(seq.tokens))
    row.past_draft = room <= 0
    return max(room, 0)


def _rooms(spec: Speculator, seqs: list[Sequence]) -> list[int]:
    """What each row may propose this step: 0 for a paused draft row."""
    rooms = []
    for seq in seqs:
        if seq.id not in spec.rows:
            spec.rows[seq.id] = new_row(spec)
        row = spec.rows[seq.id]
        if spec.kind == "lookup":
            spec = score_unverified(spec, row, seq)
            rooms.append(_room(seq, spec.k))
        elif row.pause > 0:
            row.pause -= 1
            rooms.append(0)
        else:
            rooms.append(_draft_room(spec, row, seq, _room(seq, spec.k)))
    return rooms


def _propose_lookup(
    spec: Speculator, seqs: list[Sequence], rooms: list[int], closed_batch: list[Sequence] | None
) -> list[Proposal]:
    """Every row with room proposes; the proposals of rows below the floor, and all of them
    when the step would not pay, are kept unverified, to be scored by what the rows write."""
    proposals = [Proposal([])] * len(seqs)
    for i, (seq, room) in enumerate(zip(seqs, rooms)):
        if room > 0:
            proposals[i] = _grammar_trim(seq, _lookup(spec, spec.rows[seq.id], seq, room))
    verified = [
        Proposal([]) if spec.rows[seq.id].watching else p for seq, p in zip(seqs, proposals)
    ]
    if not worth_verifying(spec, seqs, [len(p.tokens) for p in verified], closed_batch):
        verified = [Proposal([])] * len(seqs)
    for seq, p, v in zip(seqs, proposals, verified):
        if p.tokens and not v.tokens:
            spec.rows[seq.id].unverified = (len(seq.tokens), list(p.tokens))
    return verified


def _propose_draft(
    spec: Speculator,
    seqs: list[Sequence],
    rooms: list[int],
    closed_batch: list[Sequence] | None,
    clock: Callable[[], float] | None,
) -> list[Proposal]:
    """The draft's proposals for the rows with room, when they are expected to pay for the
    draft's steps and the verify forward (judged before drafting, on the rows' rooms). With
    a clock, the draft's steps are timed into spec.costs."""
    proposals = [Proposal([])] * len(seqs)
    asking = [i for i, room in enumerate(rooms) if room > 0]
    if not asking or not worth_verifying(spec, seqs, rooms, closed_batch):
        return proposals
    started, steps = clock() if clock else 0.0, max(rooms[i] for i in asking)
    spec.draft, drafted = draft_propose_batch(
        spec.draft,
        [seqs[i].id for i in asking],
        [seqs[i].tokens for i in asking],
        max(rooms[i] for i in asking),
        [seqs[i].sampling for i in asking],
        [seqs[i].generator for i in asking],
    )
    if clock is not None:
        spec.costs = with_draft(spec.costs, len(seqs), (clock() - started) / steps)
    for i, proposal in zip(asking, drafted):
        proposals[i] = _grammar_trim(seqs[i], _trim(proposal, rooms[i]))
    if not any(p.tokens for p in proposals):  # the step decodes plainly: no settle follows
        for i in asking:  # the draft fed its own guesses: only the request's tokens stand
            spec.draft = draft_rollback(spec.draft, seqs[i].id, len(seqs[i].tokens))
    return proposals


def propose(
    spec: Speculator,
    seqs: list[Sequence],
    clock: Callable[[], float] | None = None,
    closed_batch: list[Sequence] | None = None,
) -> tuple[Speculator, list[Proposal]]:
    """Each decoding sequence's proposal to verify: empty for a paused or watching row, or
    one with no room; all empty when they are not worth verifying (see worth_verifying).
    clock: the draft's steps are timed with it (engine_step's). closed_batch: every
    unfinished request when none waits to join them (see steps_saved)."""
    rooms = _rooms(spec, seqs)
    if spec.kind == "lookup":
        return spec, _propose_lookup(spec, seqs, rooms, closed_batch)
    return spec, _propose_draft(spec, seqs, rooms, closed_batch, clock)


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
        row = spec.rows[seq.id]
        # a lookup row below the floor watches rather than pauses (see _propose_lookup)
        row = fold_watched(row, n, verdict.accepted) if spec.kind == "lookup" and n else row
        row = update_rate(row, n, verdict.accepted) if spec.kind == "draft" else row
        spec = learn(spec, row, n, verdict.accepted)
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
