"""Sampling: the next token from logits, with per-row settings as tensors.

`sample` is a pure function of the logits, the settings and the random generators, applied in
this order: penalties over recent tokens, logit bias, the grammar's mask of allowed tokens,
temperature (0 = greedy), top-k, top-p, min-p, then one uniform draw per row. Each row may have its own `torch.Generator`, so a request
with a seed gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import msgspec
import torch

from astrai.infer.constraints import Constraint
from astrai.infer.events import Logprob
from astrai.kernels import pointwise


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one request is sampled and when it stops (the keyword arguments of Engine calls)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # CTRL-style: divides positive logits of recent tokens
    frequency_penalty: float = 0.0  # OpenAI-style: minus penalty x count in the window
    presence_penalty: float = 0.0  # OpenAI-style: minus penalty once per token in the window
    penalty_window: int = 64  # how many recent tokens (prompt and output) the penalties see
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []  # added to the tokenizer's stop ids
    ignore_eos: bool = False  # True: only stop_token_ids stop, not the tokenizer's
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Constraint | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.penalty_window >= 0, "penalty_window must be >= 0"),
            (self.top_logprobs >= 0, "top_logprobs must be >= 0"),
            (all(self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        ) and self.penalty_window > 0


def sampling_params(**kwargs) -> SamplingParams:
    """SamplingParams from keyword arguments, with errors that name the wrong argument."""
    try:
        return msgspec.convert(kwargs, SamplingParams, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad sampling argument: {exc}".replace("$.", "")) from None


def with_fields(sampling: SamplingParams | None, fields: dict) -> SamplingParams:
    """`sampling` (None: the defaults) with the fields given as keyword arguments replaced,
    checked as sampling_params checks them."""
    if not fields:
        return sampling or SamplingParams()
    base = msgspec.structs.asdict(sampling) if sampling is not None else {}
    return sampling_params(**{**base, **fields})


Generators = torch.Generator | list[torch.Generator | None] | None


def _column(value, batch: int, dtype, device) -> torch.Tensor:
    """A per-row setting (a number or a [B] tensor) as a [B, 1] column."""
    return torch.as_tensor(value, dtype=dtype, device=device).expand(batch)[:, None]


def _is(value, neutral) -> bool:
    """Whether a setting is `neutral` on every row, so its stage can be skipped."""
    if isinstance(value, torch.Tensor):
        return bool((value == neutral).all())
    return value == neutral


def _uniform(generator: Generators, batch: int) -> torch.Tensor:
    if isinstance(generator, list):
        return torch.stack([torch.rand((), generator=g) for g in generator])
    return torch.rand(batch, generator=generator)


def apply_penalties(logits, recent_tokens, repetition, frequency, presence):
    """Penalise tokens seen in recent_tokens [B, W] (-1 = empty slot). logits is changed."""
    B, V = logits.shape
    seen = recent_tokens >= 0
    counts = torch.zeros(B, V, device=logits.device)
    counts.scatter_add_(1, recent_tokens.clamp(min=0), seen.to(counts.dtype))
    present = counts > 0
    if not _is(repetition, 1.0):
        rep = _column(repetition, B, logits.dtype, logits.device)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(present, penalised, logits)
    if not _is(frequency, 0.0):
        logits = logits - _column(frequency, B, logits.dtype, logits.device) * counts
    if not _is(presence, 0.0):
        logits = logits - _column(presence, B, logits.dtype, logits.device) * present
    return logits


def argmax_rows(logits: torch.Tensor, block: int = 128) -> torch.Tensor:
    """logits [B, V] -> [B]: the first index of each row's maximum, as `argmax(-1)` gives it.

    On CPU, torch's argmax over a large vocabulary is much slower than its vectorised max
    (151,936 logits: 78-104 us against 17 for amax, a 2-core AMD Zen 5): float32 rows go
    through our kernel (pointwise.c: the max, then the first index holding it), others take
    the max of each block of `block` logits first, then the first block holding the row's
    maximum, then the first index inside it (below 8 rows one pass of argmax costs less than
    the blocks' six small ops; figures in docs/inference.md)."""
    B, V = logits.shape
    if (found := pointwise.argmax_rows(logits)) is not None:
        return found
    if logits.device.type != "cpu" or B < 8 or V % block or block * 8 > V:
        return logits.argmax(-1)
    blocks = logits.view(B, V // block, block)
    first = blocks.amax(-1).argmax(-1)
    inside = blocks[torch.arange(B, device=logits.device), first].argmax(-1)
    return first * block + inside


def adjusted_logits(
    logits: torch.Tensor,
    *,
    repetition_penalty=1.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    recent_tokens: torch.Tensor | None = None,
    logit_bias: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The stages of `sample` before temperature, as float32 logits [B, vocab]: penalties,
    logit bias, the grammar's mask. Greedy decoding takes their argmax."""
    logits = logits.float()
    if recent_tokens is not None and not (
        _is(repetition_penalty, 1.0) and _is(frequency_penalty, 0.0) and _is(presence_penalty, 0.0)
    ):
        logits = apply_penalties(
            logits, recent_tokens, repetition_penalty, frequency_penalty, presence_penalty
        )
    if logit_bias is not None:
        logits = logits + logit_bias
    if allowed is not None:
        # a huge penalty or bias can push every token the grammar allows to -inf (or NaN):
        # they stay the lowest finite numbers, so the mask below still leaves one to pick
        if logit_bias is not None or recent_tokens is not None:
            lowest, highest = torch.finfo(logits.dtype).min, torch.finfo(logits.dtype).max
            logits = logits.nan_to_num(nan=lowest, posinf=highest, neginf=lowest)
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The distribution `sample` draws from, [B, vocab], unnormalised once top-p or min-p
    drop tokens (draw from it with `draw`): temperature, top-k, top-p, min-p over adjusted
    logits. Rows at temperature 0 come out as at a tiny temperature; `sample` takes their
    argmax instead."""
    B, V = logits.shape
    device = logits.device
    temp = _column(temperature, B, torch.float32, device)
    logits = logits / temp.clamp(min=1e-5)
    if not _is(top_k, 0):
        k = _column(top_k, B, torch.long, device)
        k = torch.where(k <= 0, V, k.clamp(max=V))
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, k - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if not _is(top_p, 1.0):
        sorted_probs, order = probs.sort(-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop = before >= _column(top_p, B, torch.float32, device)
        drop[:, 0] = False  # the most likely token stays, also when top_p underflows to 0
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    if not _is(min_p, 0.0):
        floor = _column(min_p, B, torch.float32, device) * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def draw(probs: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """One token per row [B] from probs [B, vocab] (not necessarily normalised), by one
    uniform draw per row from its generator."""
    V = probs.shape[1]
    cdf = probs.cumsum(-1)
    target = _uniform(generator, len(probs)).to(probs.device) * cdf[:, -1]
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp(max=V - 1)


def sample(
    logits: torch.Tensor,
    generator: Generators = None,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    recent_tokens: torch.Tensor | None = None,
    logit_bias: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token ids [B] from logits [B, vocab].

    Each setting is a number for the whole batch or a [B] tensor, one value per row.
    generator: one torch.Generator for the batch, or a list with one per row (None = torch's
    global generator). recent_tokens [B, W] (-1 = empty) are what the penalties look at;
    logit_bias [B, vocab] is added to the logits. allowed [B, vocab] (bool) masks out every
    token it marks False, before any other stage sees the logits (see constraints.py).
    """
    logits = adjusted_logits(
        logits,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        recent_tokens=recent_tokens,
        logit_bias=logit_bias,
        allowed=allowed,
    )
    greedy_ids = argmax_rows(logits)
    if _is(temperature, 0.0):
        return greedy_ids
    probs = probabilities(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    sampled = draw(probs, generator)
    temp = _column(temperature, len(logits), torch.float32, logits.device)
    return torch.where(temp[:, 0] == 0, greedy_ids, sampled)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities as OpenAI reports them: log_softmax of the raw logits.

    Returns (logprob of each chosen token [B], top_n ids [B, n], their logprobs [B, n])."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(1, token_ids[:, None])[:, 0]
    top = logp.topk(top_n, dim=-1) if top_n else None
    if top is None:
        empty = logp.new_zeros(len(logp), 0)
        return chosen, empty.long(), empty
    return chosen, top.indices, top.values


def _plain_greedy(sp: SamplingParams) -> bool:
    """Whether the row's token is the argmax of its raw logits."""
    return sp.temperature == 0 and not (sp.has_penalties or sp.logit_bias)


def sample_ids(
    logits: torch.Tensor,
    settings: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[list[int]] | None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id per row [B], each row with its own request's settings and generator.

    histories are the rows' tokens so far, for the penalty windows (None when no row has
    penalties); allowed the rows' masks of allowed tokens (see constraints.allowed_tokens),
    None when no row is constrained."""
    if allowed is None and all(_plain_greedy(sp) for sp in settings):
        # what `sample` would do for these rows, without its checks, which for one stream
        # cost as much as the argmax
        return argmax_rows(logits)

    def per_row(name: str):
        values = [getattr(sp, name) for sp in settings]
        if all(v == values[0] for v in values):
            return values[0]  # one number: stages that do nothing are skipped
        return torch.tensor(values, device=logits.device)

    recent = None
    if any(sp.has_penalties for sp in settings):
        windows = [
            tokens[-sp.penalty_window :] if sp.has_penalties else []
            for tokens, sp in zip(histories, settings)
        ]
        width = max(len(w) for w in windows)
        padded = [[-1] * (width - len(w)) + w for w in windows]
        recent = torch.tensor(padded, device=logits.device)
    bias = None
    if any(sp.logit_bias for sp in settings):
        bias = torch.zeros_like(logits)
        for row, sp in enumerate(settings):
            for token, value in (sp.logit_bias or {}).items():
                bias[row, token] = value
    return sample(
        logits,
        generators,
        temperature=per_row("temperature"),
        top_k=per_row("top_k"),
        top_p=per_row("top_p"),
        min_p=per_row("min_p"),
        repetition_penalty=per_row("repetition_penalty"),
        frequency_penalty=per_row("frequency_penalty"),
        presence_penalty=per_row("presence_penalty"),
        recent_tokens=recent,
        logit_bias=bias,
        allowed=allowed,
    )


def sample_requests(
    logits: torch.Tensor,
    settings: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[list[int]],
    allowed: torch.Tensor | None = None,
) -> list[tuple[int, Logprob | None]]:
    """sample_ids as Python ints, each with its Logprob when the request asked for them."""
    ids = sample_ids(logits, settings, generators, histories, allowed)
    id_list = ids.tolist()
    logprobs: list[Logprob | None] = [None] * len(settings)
    if any(sp.logprobs for sp in settings):
        top_n = max(sp.top_logprobs for sp in settings)
        chosen, top_ids, top_lp = (t.tolist() for t in token_logprobs(logits, ids, top_n))
        for row, sp in enumerate(settings):
            if sp.logprobs:
                top = list(zip(top_ids[row], top_lp[row]))[: sp.top_logprobs]
                logprobs[row] = Logprob(id_list[row], chosen[row], top)
    return list(zip(id_list, logprobs))
