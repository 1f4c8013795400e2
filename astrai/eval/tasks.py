"""The three kinds of task as functions of a model and a task's settings -> a dict of metrics.

perplexity  loss (nats per token), perplexity, bits per byte, over every token of the data
generation  accuracy (and pass@k) of completions generated through the Engine
choice      accuracy of the option with the highest log-likelihood: summed, per token and
            per byte of the option (the last two are lm-evaluation-harness's acc_norm kinds)
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import numpy as np
import torch

from astrai.config import EvalTask, ModelConfig
from astrai.data import IGNORE, get_example, open_dataset
from astrai.eval.loglik import Pair, rolling_pairs, score_pairs
from astrai.eval.scoring import call_reward, pass_at_k, record_fields, scorer_for
from astrai.infer import Engine
from astrai.model import forward, token_logps

Progress = Callable[[int, int], None]


class Model(NamedTuple):
    """What every task reads: the weights, their shape, the tokenizer and the longest input."""

    params: dict[str, torch.Tensor]
    cfg: ModelConfig
    tokenizer: Any
    max_len: int


def model_of(params, cfg: ModelConfig, tokenizer, max_len: int | None = None) -> Model:
    return Model(params, cfg, tokenizer, max_len or cfg.max_position_embeddings)


# --- data ----------------------------------------------------------------------------------------


def read_records(path: str | Path, limit: int = 0) -> list[dict]:
    """The records of a JSONL file (the first `limit`, 0 = all); a bad line names file and line."""
    path = Path(path)
    records = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: invalid JSON: {exc}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: a record must be a JSON object")
        records.append(record)
        if limit and len(records) == limit:
            break
    return records


def field(record: dict, key: str, where: str, kind: type | tuple[type, ...]):
    if key not in record:
        raise ValueError(f"{where}: the record has no {key!r}")
    if not isinstance(record[key], kind):
        raise ValueError(f"{where}: {key!r} must be a {getattr(kind, '__name__', kind)}")
    return record[key]


def checksum(path: str | Path) -> str:
    """sha256 of a file, or of every file of a folder (names and contents, sorted)."""
    path, digest = Path(path), hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            digest.update(str(f.relative_to(path)).encode() + b"\0")
        with f.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def bar(name: str, stream: TextIO | None = sys.stderr) -> Progress:
    """A progress bar on `stream` (None: silent), redrawn in place; the last call ends it."""

    def show(done: int, total: int) -> None:
        if stream is None:
            return
        frac = done / total if total else 1.0
        stream.write(f"\r{name:<24} [{'#' * int(frac * 30):.<30}] {done}/{total}")
        stream.write("\n" if done >= total else "")
        stream.flush()

    return show


# --- perplexity ---------------------------------------------------------------------------------


def text_pairs(model: Model, texts: list[str]) -> tuple[list[Pair], int]:
    """Rolling windows over every text, each text scored after an end-of-text token (so its
    first token counts too), and the texts' UTF-8 bytes."""
    tok = model.tokenizer
    prefix = tok.eos_id if tok.eos_id is not None else tok.bos_id
    if prefix is None:
        raise ValueError("perplexity needs the tokenizer's eos (or bos) token to start a text")
    pairs = [p for t in texts for p in rolling_pairs(prefix, tok.encode(t), model.max_len)]
    return pairs, sum(len(t.encode()) for t in texts)


def shard_sums(model: Model, task: EvalTask, batch_size: int, progress: Progress):
    """(summed negative log-likelihood, tokens, bytes) of the trained tokens of a prepared
    folder; the bytes are those of the target tokens' text."""
    data = open_dataset(task.data)
    n = min(len(data), task.limit) if task.limit else len(data)
    nll, tokens, nbytes = 0.0, 0, 0
    for start in range(0, n, batch_size):
        rows = [get_example(data, i) for i in range(start, min(start + batch_size, n))]
        batch = padded_rows(rows, IGNORE)
        labels = batch.pop("labels")
        with torch.inference_mode():
            logits = _forward(model, **batch)
        nll -= float(token_logps(logits, labels.to(logits.device)).sum())
        tokens += int((labels != IGNORE).sum())
        for r in rows:
            targets = [int(t) for t in np.asarray(r["labels"]) if t != IGNORE]
            nbytes += len(model.tokenizer.decode(targets, skip_special_tokens=False).encode())
        progress(min(start + batch_size, n), n)
    return nll, tokens, nbytes


def padded_rows(rows: list[dict], ignore: int) -> dict[str, torch.Tensor]:
    """Examples right-padded into a batch: input_ids, labels (`ignore` on padding) and, when
    the rows have them, positions and doc_ids (padding is a document of its own)."""
    width = max(len(r["input_ids"]) for r in rows)
    fill = {"input_ids": 0, "labels": ignore, "positions": 0, "doc_ids": -1}
    batch = {}
    for key, value in fill.items():
        if key not in rows[0]:
            continue
        batch[key] = torch.full((len(rows), width), value, dtype=torch.long)
        for k, r in enumerate(rows):
            batch[key][k, : len(r[key])] = torch.as_tensor(r[key])
    return batch


def _forward(model: Model, input_ids, positions=None, doc_ids=None) -> torch.Tensor:
    device = next(iter(model.params.values())).device
    extra = {
        name: t.to(device)
        for name, t in (("positions", positions), ("doc_ids", doc_ids))
        if t is not None
    }
    return forward(model.params, model.cfg, input_ids.to(device), **extra).float()


def perplexity(model: Model, task: EvalTask, batch_size: int, progress: Progress) -> dict:
    if Path(task.data).is_dir():
        nll, tokens, nbytes = shard_sums(model, task, batch_size, progress)
    else:
        records = read_records(task.data, task.limit)
        texts = [
            field(r, task.text_key, f"{task.data} record {i + 1}", str)
            for i, r in enumerate(records)
        ]
        pairs, nbytes = text_pairs(model, texts)
        scored = score_pairs(model.params, model.cfg, pairs, batch_size, model.max_len, progress)
        nll = -sum(s.total for s in scored)
        tokens = sum(len(s.logprobs) for s in scored)
    loss = nll / max(tokens, 1)
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": nll / math.log(2) / max(nbytes, 1),
        "tokens": tokens,
        "bytes": nbytes,
    }


# --- multiple choice ----------------------------------------------------------------------------


def prompt_text(model: Model, record: dict, task: EvalTask, where: str, chat: bool) -> str:
    """A record's prompt: its chat `messages` through the template, or `prompt_key`'s text
    (through the template as one user turn when `chat`)."""
    if "messages" in record:
        messages = field(record, "messages", where, list)
        return model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = field(record, task.prompt_key, where, str)
    if chat:
        return model.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return text


def continuation_pair(tokenizer, context: str, continuation: str) -> Pair:
    """Token ids of context and continuation as the whole text tokenises, as
    lm-evaluation-harness splits them: the context's trailing spaces go with the continuation
    (byte-level BPE glues a space to the word after it), and so does a token merged across the
    boundary."""
    spaces = len(context) - len(context.rstrip())
    if spaces and context.strip():
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    head = tokenizer.encode(context)
    while head and whole[: len(head)] != head:  # the boundary token merged: it joins the tail
        head = head[:-1]
    if not head:
        eos = tokenizer.eos_id
        if eos is None:
            raise ValueError("an empty prompt needs the tokenizer's eos token as its context")
        return [eos], whole
    return head, whole[len(head) :]


def choice(model: Model, task: EvalTask, batch_size: int, progress: Progress) -> dict:
    records = read_records(task.data, task.limit)
    pairs, owners, options, answers = [], [], [], []
    for i, record in enumerate(records):
        where = f"{task.data} record {i + 1}"
        context = prompt_text(model, record, task, where, chat=False)
        choices = field(record, task.choices_key, where, list)
        answer = field(record, task.answer_key, where, int)
        if not 0 <= answer < len(choices):
            raise ValueError(f"{where}: {task.answer_key!r} = {answer} is not an option's index")
        for option in choices:
            pairs.append(continuation_pair(model.tokenizer, context, str(option)))
            owners.append(i)
            options.append(str(option))
        answers.append(answer)
    scored = score_pairs(model.params, model.cfg, pairs, batch_size, model.max_len, progress)
    by_record: list[list[tuple[float, float, float]]] = [[] for _ in records]
    for owner, option, s in zip(owners, options, scored):
        by_record[owner].append(
            (s.total, s.total / max(len(s.logprobs), 1), s.total / max(len(option.encode()), 1))
        )
    picks = [[max(range(len(o)), key=lambda k, j=j: o[k][j]) for j in range(3)] for o in by_record]
    n = max(len(records), 1)
    return {
        name: sum(p[j] == a for p, a in zip(picks, answers)) / n
        for j, name in enumerate(("accuracy", "accuracy_per_token", "accuracy_per_byte"))
    } | {"records": len(records)}


# --- generation ---------------------------------------------------------------------------------


def sampling(task: EvalTask, sample: int) -> dict:
    return {
        "max_tokens": task.max_tokens,
        "temperature": task.temperature,
        "top_p": task.top_p,
        "top_k": task.top_k,
        "seed": task.seed + sample,
        "stop": list(task.stop),
    }


def generation(model: Model, task: EvalTask, batch_size: int, progress: Progress) -> dict:
    records = read_records(task.data, task.limit)
    prompts = [
        prompt_text(model, r, task, f"{task.data} record {i + 1}", chat=task.chat)
        for i, r in enumerate(records)
    ]
    completions: list[list[str]] = [[] for _ in records]
    chunk = batch_size * 4  # enough to keep the batch full, few enough to show progress
    total = len(records) * task.samples
    device = str(next(iter(model.params.values())).device)
    engine = Engine(model.params, model.cfg, model.tokenizer, max_batch=batch_size, device=device)
    with engine:
        for sample in range(task.samples):
            for start in range(0, len(prompts), chunk):
                outs = engine.generate(prompts[start : start + chunk], **sampling(task, sample))
                for k, out in enumerate(outs):
                    if out.finish_reason == "error":
                        raise RuntimeError(f"task {task.name!r}: generation failed: {out.error}")
                    completions[start + k].append(out.text)
                progress(sample * len(prompts) + start + len(outs), total)
    return score_generations(task, records, prompts, completions)


def score_generations(
    task: EvalTask, records: list[dict], prompts: list[str], completions: list[list[str]]
) -> dict:
    """Accuracy (mean score of all completions) and, with several samples, pass@k; plus the
    first completions, to show what the model wrote."""
    flat_prompts = [p for p, cs in zip(prompts, completions) for _ in cs]
    flat = [c for cs in completions for c in cs]
    fields = record_fields(records, task.samples)
    name = f"{task.score} (task {task.name!r})"
    scores = call_reward(name, scorer_for(task), flat_prompts, flat, fields)
    metrics: dict[str, Any] = {"accuracy": sum(scores) / max(len(scores), 1)}
    if task.samples > 1:
        right, at = [], 0
        for cs in completions:
            right.append(sum(s > 0 for s in scores[at : at + len(cs)]))
            at += len(cs)
        for k in sorted({1, task.samples}):
            values = [pass_at_k(task.samples, c, k) for c in right]
            metrics[f"pass@{k}"] = sum(values) / max(len(values), 1)
    metrics["records"] = len(records)
    metrics["examples"] = [  # the record's own prompt (not the chat template around it)
        {
            "prompt": r.get(task.prompt_key, p),
            "completion": cs[0],
            "score": scores[i * task.samples],
        }
        for i, (r, p, cs) in enumerate(list(zip(records, prompts, completions))[:3])
    ]
    return metrics


RUNNERS = {"perplexity": perplexity, "generation": generation, "choice": choice}


def run_task(model: Model, task: EvalTask, batch_size: int, log: TextIO | None = None) -> dict:
    """One task's metrics; a progress bar on `log` (None: none)."""
    return RUNNERS[task.kind](model, task, batch_size, bar(task.name, log))
