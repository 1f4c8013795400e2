"""Our side: the Engine, a bare prefill + decode_step loop, forward / paged prefill, and
train_step, each driven the way a user of the library would call it.

The inference and training packages are imported inside the functions, so a section whose
piece is missing can say so and the others still run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from astrai.config import ModelConfig
from astrai.infer.pages import pages_for

from .models import Workload

PAGE_SIZE = 16


def make_engine(
    params, cfg: ModelConfig, tokenizer, work: Workload, device, dtype, quantize=None, **settings
):
    """An Engine sized for the workload: room for the largest batch of full sequences, so no
    request waits for pages and nothing is preempted. settings: more EngineConfig fields
    (speculative, draft_model, ...)."""
    from astrai.infer import Engine

    max_batch = max((*work.concurrency, work.clients, 1))
    max_len = work.prompt_len + work.new_tokens
    return Engine(
        params,
        cfg,
        tokenizer,
        num_pages=max_batch * pages_for(max_len, PAGE_SIZE) + 8,
        page_size=PAGE_SIZE,
        max_batch=max_batch,
        max_seq_len=pages_for(max_len, PAGE_SIZE) * PAGE_SIZE,
        device=device,
        dtype=dtype,
        quantize=quantize,
        **settings,
    )


def engine_generate(
    engine, prompts: list[list[int]], new_tokens: int, **sampling
) -> list[list[int]]:
    """Greedy completions of new_tokens each, with no stop token (that each has as many is
    checked with the other side's, verify.py)."""
    completions = engine.generate(
        prompts, max_tokens=new_tokens, temperature=0.0, ignore_eos=True, **sampling
    )
    return [c.token_ids for c in completions]


def prepared(params, cfg: ModelConfig, quantize: str | None = None):
    """The weights laid out for inference, as the Engine prepares them."""
    from astrai.infer import prepare_params

    return prepare_params(params, quantize)


@torch.inference_mode()
def greedy_decode(params, cfg: ModelConfig, prompt: list[int], new_tokens: int) -> list[int]:
    """The loop a user writes from the pure pieces: pages for the whole sequence, prefill the
    prompt, then one decode_step and an argmax per token."""
    from astrai.infer import alloc_pages, decode_step, init_pages, prefill

    weight = params["model.norm.weight"]
    device, dtype = weight.device, weight.dtype
    n = pages_for(len(prompt) + new_tokens, PAGE_SIZE)
    pool = init_pages(cfg, n, PAGE_SIZE, dtype, device)
    pool, pages = alloc_pages(pool, n)
    table = torch.tensor([pages], device=device)
    logits, pool = prefill(params, cfg, pool, torch.tensor([prompt], device=device), table, 0)
    token = logits.argmax(-1)
    out = [token]
    position = torch.tensor([len(prompt)], device=device)
    for _ in range(new_tokens - 1):
        logits, pool = decode_step(params, cfg, pool, token, position, table)
        token = logits.argmax(-1)
        out.append(token)
        position += 1
    return torch.cat(out).tolist()


def paged_prefill_fn(params, cfg: ModelConfig, batch: int, length: int) -> Callable:
    """tokens [batch, length] -> last logits, through the paged prefill into a pool made once
    (each call overwrites the same pages)."""
    from astrai.infer import alloc_pages, init_pages, prefill

    weight = params["model.norm.weight"]
    per_row = pages_for(length, PAGE_SIZE)
    pool = init_pages(cfg, batch * per_row, PAGE_SIZE, weight.dtype, weight.device)
    pool, pages = alloc_pages(pool, batch * per_row)
    table = torch.tensor(pages, device=weight.device).view(batch, per_row)
    state = {"pool": pool}

    @torch.inference_mode()
    def run(tokens: torch.Tensor) -> torch.Tensor:
        logits, state["pool"] = prefill(params, cfg, state["pool"], tokens, table, 0)
        return logits

    return run


@torch.inference_mode()
def forward_logits(params, cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    import astrai

    return astrai.forward(params, cfg, tokens)


def train_step_fn(
    params, cfg: ModelConfig, work: Workload, compile: bool, hyper: dict, precision="float32"
):
    """batch -> loss through init_train_state / train_step (the state is carried inside).
    precision "bfloat16": bf16 compute under autocast, float32 weights and moments."""
    from astrai.config import OptimizerConfig, ScheduleConfig, TrainConfig
    from astrai.train import init_train_state, train_step

    batch = work.train[0]
    train_cfg = TrainConfig(
        model=cfg,
        batch_size=batch,
        compile=compile,
        precision=precision,
        progress=False,
        optimizer=OptimizerConfig(
            lr=hyper["lr"],
            beta1=hyper["betas"][0],
            beta2=hyper["betas"][1],
            weight_decay=hyper["weight_decay"],
            max_grad_norm=hyper["max_grad_norm"],
        ),
        schedule=ScheduleConfig(name="constant"),
    )
    state = {"train": init_train_state(params, train_cfg)}

    def step(batch: dict) -> float:
        state["train"], metrics = train_step(state["train"], batch)
        return metrics["loss"]

    return step


# A JSON array of records that never closes, so that a constrained request decodes exactly as
# many tokens as a free one while its mask is computed at every step.
ENDLESS_RECORDS = (
    'start: "[" items\n'
    'items: item ", " items\n'  # no way out: the array never closes
    'item: %json {"x-guidance": {"whitespace_flexible": false, "key_separator": ": ", '
    '"item_separator": ", "}, "type": "object", "properties": {"id": {"type": "integer", '
    '"minimum": 0, "maximum": 999}, "name": {"type": "string", "maxLength": 12}, "tags": '
    '{"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}}, '
    '"required": ["id", "name", "tags"], "additionalProperties": false}'
)


def json_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on JSON records, its vocabulary filled up to exactly
    vocab_size with plain tokens ("f0", "f1", ...): every id a model of that size may choose
    decodes to text, as with a real tokenizer (an id past the vocabulary decodes to nothing,
    and a stream decoder then decodes ever more ids at each token)."""
    import json

    import tokenizers

    from astrai.tokenizer import Tokenizer

    records = [
        f'{{"id": {i}, "name": "item {i % 97}", "tags": ["red", "blue"]}}' for i in range(2000)
    ]
    trained = Tokenizer.train([", ".join(records)], vocab_size=min(vocab_size, 2048))
    spec = json.loads(trained.backend.to_str())
    vocab = spec["model"]["vocab"]
    fill = (f"f{i}" for i in itertools.count() if f"f{i}" not in vocab)
    vocab |= {next(fill): i for i in range(trained.vocab_size, vocab_size)}
    backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
    specials = {"bos_token": trained.bos_token, "eos_token": trained.eos_token}
    return Tokenizer(backend, **specials, pad_token=trained.pad_token)


def endless_records():
    from astrai.infer.constraints import lark

    return lark(ENDLESS_RECORDS)
