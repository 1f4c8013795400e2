"""Which proposed tokens to keep, from the target's logits at the k + 1 verified positions.

Row j of the logits is the target's prediction after the request's tokens and the first j
proposed ones; row k, after all of them. Greedy keeps the longest prefix of the proposal
equal to the target's argmax, then one token of the target's own: the correction at the first
mismatch, or the bonus after the last proposed token. The tokens are then exactly greedy
decoding's.

Sampling keeps the same shape with rejection sampling (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding"): accept proposed token d with probability
min(1, p(d) / q(d)), where p is the target's distribution after every transform of
sampling.py and q the one the proposer drew d from (one-hot for a deterministic proposer);
at the first rejection, draw from max(0, p - q) normalised; after k acceptances, draw the bonus
from p. Each kept token is then distributed exactly as `sample` would have drawn it, though a
seed's stream of tokens differs from the one without speculation (the generator is consumed
differently).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from astrai.infer.proposal import Proposal, check_proposal
from astrai.infer.sampling import (
    SamplingParams,
    adjusted_logits,
    argmax_rows,
    draw,
    probabilities,
)


class Verdict(NamedTuple):
    tokens: list[int]  # the accepted proposed tokens, then one token of the target's
    accepted: int  # how many proposed tokens were kept


def verify_greedy(logits: torch.Tensor, proposed: list[list[int]]) -> list[Verdict]:
    """Greedy verification of a batch: logits [B, K + 1, vocab] (row b valid up to
    len(proposed[b]) + 1), proposed[b] up to K token ids. The tokens of argmax decoding."""
    B, K1, V = logits.shape
    target = argmax_rows(logits.reshape(B * K1, V)).view(B, K1).tolist()
    verdicts = []
    for row, tokens in zip(target, proposed):
        n = 0
        while n < len(tokens) and tokens[n] == row[n]:
            n += 1
        verdicts.append(Verdict([*tokens[:n], row[n]], n))
    return verdicts


def request_logits(
    logits: torch.Tensor,
    sp: SamplingParams,
    history: list[int],
    proposed: list[int] = (),
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The request's logits [n, vocab] after penalties, logit bias and grammar mask, row j
    seeing history + proposed[:j] in its penalty window (the context it was computed in).
    allowed [n, vocab]: the grammar's mask at each row, or None."""
    n = len(logits)
    recent = None
    if sp.has_penalties:
        seen = list(history) + list(proposed[: n - 1])
        windows = [seen[: len(history) + j][-sp.penalty_window :] for j in range(n)]
        width = max(len(w) for w in windows)
        recent = torch.tensor([[-1] * (width - len(w)) + w for w in windows], dtype=torch.long)
        recent = recent.to(logits.device)
    bias = None
    if sp.logit_bias:
        bias = torch.zeros(logits.shape[-1], device=logits.device)
        for token, value in sp.logit_bias.items():
            bias[token] = value
        bias = bias.expand(n, -1)
    return adjusted_logits(
        logits,
        repetition_penalty=sp.repetition_penalty,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        recent_tokens=recent,
        logit_bias=bias,
        allowed=allowed,
    )


def request_probs(adjusted: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws the request's token from, one row per position,
    unnormalised as `probabilities` leaves it."""
    return probabilities(
        adjusted, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p
    )


def verify_sampled(
    logits: torch.Tensor,
    proposal: Proposal,
    sp: SamplingParams,
    generator: torch.Generator | None,
    history: list[int],
    allowed: torch.Tensor | None = None,
) -> Verdict:
    """Verify one request's proposal: logits [len(proposal.tokens) + 1, vocab] from the
    target, history = the request's tokens before the proposal. With temperature 0 this is
    greedy verification over the adjusted logits and draws nothing; otherwise it consumes one
    uniform per proposed token it examines plus one for the final token."""
    tokens, q = proposal
    k = len(tokens)
    if len(logits) != k + 1:
        raise ValueError(
            f"logits: expected {k + 1} rows for {k} proposed tokens, got {len(logits)}"
        )
    check_proposal(proposal, logits.shape[-1])
    adjusted = request_logits(logits, sp, history, tokens, allowed)
    if sp.temperature == 0:
        return verify_greedy(adjusted[None], [list(tokens)])[0]
    probs = request_probs(adjusted, sp)
    p = probs / probs.sum(-1, keepdim=True)
    for j, d in enumerate(tokens):
        u = float(torch.rand((), generator=generator))
        q_d = 1.0 if q is None else float(q[j, d])
        if u * q_d < float(p[j, d]):  # u < p/q, without dividing by a q of 0
            continue
        residual = (p[j] - q[j]).clamp(min=0) if q is not None else p[j].clone()
        if q is None:
            residual[d] = 0.0  # p - onehot(d), clamped
        if not bool(residual.sum() > 0):  # p equal to q: a rejection of probability 0
            residual = p[j]
        return Verdict([*tokens[:j], int(draw(residual[None], [generator]))], j)
    # the bonus, drawn from `sample`'s own distribution with its one uniform
    return Verdict([*tokens, int(draw(probs[k][None], [generator]))], k)
