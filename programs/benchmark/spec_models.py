"""The speculation section's models and traffic: a target trained so that proposals can be
accepted, and a draft distilled from it, both written once under <out>/models and reused.

The target learns two things at once, row by row: copying (speculation.py's task: a document,
SEP, the document again, the loss on the copy) and "chat": text from a fixed random Markov
chain over the vocabulary, whose next token it can predict from the last one but which never
repeats the prompt. Grounded traffic (quoting the document) is where prompt lookup pays;
chat-like traffic (continuing chain text) is where only a draft can guess. The draft, a
quarter of the target's width and half its depth (four layers at most), is distilled from it
(astrai/train/distill.py's `distill_loss`) on the same rows. Each shape trains by its RECIPES
entry.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

import astrai as ai
from astrai.hardware import native_bf16
from astrai.train.distill import with_teacher_logps

from .models import COMMON, SIZES
from .speculation import DOC, IGNORE, QUOTE, SEP, VOCAB, copy_batch

ROW = DOC + 1 + QUOTE  # tokens per training row, copy or chain
SUCCESSORS = 4  # each token's possible next tokens in the chain; the first is the likeliest
SPEC_FILE = "bench-spec.json"
DRAFT_LAYERS = 4  # a draft step must cost a small part of a target step at batch 1


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a shape's models are trained: `steps` for the target (a quick run takes its own),
    `draft_steps` for the draft's distillation (default: as many)."""

    steps: int = 300
    rows: int = 16
    lr: float = 2e-3
    warmup: int | None = None  # default: a tenth of the steps
    bf16: bool = False  # autocast where bf16 is native: ~2x the steps a second there
    draft_steps: int | None = None


# The 30-layer smol target sits on the loss plateau of an untrained model far longer than the
# 8-layer small one: at 16 rows and lr 1e-3 or 3e-3 still at ~6.8 after 100 steps; at 8 rows
# and lr 3e-3 it leaves the plateau after ~150 steps and copies from ~1,000 (docs/benchmarks.md).
RECIPES = {"smol": Recipe(steps=1200, rows=8, lr=3e-3, warmup=20, bf16=True, draft_steps=400)}


def chain_table(vocab: int, seed: int = 5) -> torch.Tensor:
    """[vocab, SUCCESSORS] next tokens of the Markov chain (ids 2 and up: 0 and SEP stay out)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (vocab, SUCCESSORS), generator=generator)


def chain_text(table: torch.Tensor, rows: int, length: int, generator) -> torch.Tensor:
    """rows x length tokens of the chain: the first successor half of the time, else another."""
    out = torch.empty(rows, length, dtype=torch.long)
    out[:, 0] = torch.randint(2, table.shape[0], (rows,), generator=generator)
    for t in range(1, length):
        pick = torch.where(
            torch.rand(rows, generator=generator) < 0.5,
            torch.zeros(rows, dtype=torch.long),
            torch.randint(1, SUCCESSORS, (rows,), generator=generator),
        )
        out[:, t] = table[out[:, t - 1], pick]
    return out


def mixed_batch(table: torch.Tensor, batch: int, generator) -> dict:
    """Half copy rows (the loss on the copy), half chain rows (the loss everywhere)."""
    copies = copy_batch(table.shape[0], batch // 2, generator)
    chain = chain_text(table, batch - batch // 2, ROW, generator)
    labels = torch.full_like(chain, IGNORE)
    labels[:, :-1] = chain[:, 1:]
    return {
        "input_ids": torch.cat([copies["input_ids"], chain]),
        "labels": torch.cat([copies["labels"], labels]),
    }


def _configs(shape: str) -> tuple[ai.ModelConfig, ai.ModelConfig]:
    common = {k: v for k, v in COMMON.items() if k != "model_type"}  # ours, not Llama's file
    target = ai.ModelConfig(**{**common, **SIZES[shape], "vocab_size": VOCAB})
    draft = ai.ModelConfig(
        **{
            **common,
            **SIZES[shape],
            "vocab_size": VOCAB,
            "hidden_size": max(32, target.hidden_size // 4),
            "intermediate_size": max(64, target.intermediate_size // 4),
            "num_hidden_layers": max(1, min(DRAFT_LAYERS, target.num_hidden_layers // 2)),
        }
    )
    return target, draft


def _train(cfg, recipe: Recipe, steps: int, table, teacher: Path | None = None, log=print):
    """steps of AdamW on mixed batches; with a teacher folder, distilled from it ([distill])."""
    distill = ai.config.DistillConfig(teacher=str(teacher) if teacher else "")
    train_cfg = ai.TrainConfig(
        model=cfg,
        max_steps=steps,
        batch_size=recipe.rows,
        optimizer=ai.config.OptimizerConfig(lr=recipe.lr, weight_decay=0.0),
        schedule=ai.config.ScheduleConfig(warmup_steps=recipe.warmup or max(1, steps // 10)),
        precision="bfloat16" if recipe.bf16 and native_bf16("cpu") else "float32",
        progress=False,
        compile=False,
        distill=distill,
    )
    state = ai.init_train_state(ai.init_params(cfg, seed=0), train_cfg)
    generator = torch.Generator().manual_seed(0)
    model = ai.load_pretrained(teacher) if teacher else None
    which = "draft" if teacher else "target"
    for step in range(1, steps + 1):
        batch = mixed_batch(table, recipe.rows, generator)
        if model is not None:
            batch = with_teacher_logps(batch, model, distill.temperature)
        state, metrics = ai.train_step(state, batch)
        if step % 100 == 0:  # a long recipe says where it is
            log(f"{which} step {step}/{steps}: loss {float(metrics['loss']):.3f}")
    return state.params


def spec_models(root: Path, shape: str, quick: bool, log=print) -> tuple[Path, Path]:
    """(target folder, draft folder) under root (the benchmark's models folder), trained once
    by the shape's recipe (20 steps each when quick)."""
    recipe = RECIPES.get(shape, Recipe())
    steps = 20 if quick else recipe.steps
    draft_steps = 20 if quick else recipe.draft_steps or steps
    folder = root / f"spec-{shape}-{steps}"
    spec = {"shape": SIZES[shape], "recipe": dataclasses.asdict(recipe), "row": ROW, "vocab": VOCAB}
    spec |= {"steps": steps, "draft_steps": draft_steps}
    target, draft = folder / "target", folder / "draft"
    try:
        if json.loads((folder / SPEC_FILE).read_text()) == spec:
            return target, draft
    except (OSError, ValueError):
        pass
    table = chain_table(VOCAB)
    target_cfg, draft_cfg = _configs(shape)
    ai.save_pretrained(target, _train(target_cfg, recipe, steps, table, log=log), target_cfg)
    draft_params = _train(draft_cfg, recipe, draft_steps, table, teacher=target, log=log)
    ai.save_pretrained(draft, draft_params, draft_cfg)
    (folder / SPEC_FILE).write_text(json.dumps(spec))
    return target, draft


def grounded_prompts(count: int, new_tokens: int, seed: int = 1) -> list[list[int]]:
    """A document, SEP and the start of its quote: the model goes on quoting."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        doc = torch.randint(2, VOCAB, (DOC,), generator=generator).tolist()
        copied = int(torch.randint(1, max(2, QUOTE - new_tokens), (), generator=generator))
        out.append([*doc, SEP, *doc[:copied]])
    return out


def chat_prompts(count: int, length: int, seed: int = 2) -> list[list[int]]:
    """Chain text: the continuation is predictable from the last token, and not in the prompt."""
    generator = torch.Generator().manual_seed(seed)
    return chain_text(chain_table(VOCAB), count, length, generator).tolist()


def random_prompts(count: int, length: int, seed: int = 3) -> list[list[int]]:
    """Uniform random tokens: neither the prompt nor the chain says what comes next, so
    proposals are rarely kept (the traffic where speculation must back off)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (count, length), generator=generator).tolist()


def misleading_prompts(count: int, length: int, seed: int = 6) -> list[list[int]]:
    """Traffic where prompt lookup proposes at every step and is wrong at once: the model
    continues a start token z along the chain's likeliest successors (z, f(z), f(f(z)), ...,
    as it learned), and the prompt holds each pair of that path, (p_i, p_i+1), followed by
    another successor of p_i+1. So each pair the model writes occurred before, and lookup
    proposes what followed it there, which the model does not write. The prompt ends with z;
    `length` pairs cover a continuation of `length` tokens."""
    table = chain_table(VOCAB)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        path = [int(torch.randint(2, VOCAB, (), generator=generator))]
        while len(path) < length + 2:
            path.append(int(table[path[-1], 0]))
        prompt = []
        for i in range(length + 1):
            other = int(torch.randint(1, SUCCESSORS, (), generator=generator))
            prompt += [path[i], path[i + 1], int(table[path[i + 1], other])]
        out.append([*prompt, path[0]])
    return out
