"""Perplexity is exact: exp of the mean token loss `forward` gives on the same data, with
bits per byte from the texts' UTF-8 bytes, through `just eval`'s program."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from eval_fixtures import TEXTS

import astrai
from astrai.eval.loglik import rolling_pairs


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def reference_nll(model_dir, texts):
    """Summed next-token loss of each text after an end-of-text token, from `forward`."""
    params, cfg = astrai.load_pretrained(model_dir)
    tok = astrai.Tokenizer.from_pretrained(model_dir)
    total, count = 0.0, 0
    for text in texts:
        ids = torch.tensor([[tok.eos_id, *tok.encode(text)]])
        logits = astrai.forward(params, cfg, ids)
        total += F.cross_entropy(logits[0, :-1].double(), ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return total, count


def run_eval(*argv):
    import eval as eval_program  # programs/eval.py (programs/ is on pytest's path)

    assert eval_program.main([*argv, "--quiet"]) == 0


def test_perplexity_equals_exp_of_the_mean_forward_loss(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "results.json"
    run_eval("--model", str(model_dir), "--data", str(data), "--out", str(out))
    result = json.loads(out.read_text())["tasks"][0]
    assert result["kind"] == "perplexity"
    metrics = result["metrics"]
    nll, count = reference_nll(model_dir, TEXTS)
    eps = torch.finfo(torch.float32).eps
    assert metrics["tokens"] == count
    assert metrics["loss"] == pytest.approx(nll / count, rel=64 * eps)
    assert metrics["perplexity"] == pytest.approx(math.exp(nll / count), rel=64 * eps)
    assert result["checksum"].startswith("sha256:")


def test_an_adapter_is_evaluated_as_its_merged_model(model_dir, tmp_path):
    params, cfg = astrai.load_pretrained(model_dir)
    lora = astrai.init_lora(params, cfg, rank=4, targets=("q_proj", "down_proj"))
    for pair in lora["weights"].values():
        pair["B"] = torch.randn(pair["B"].shape, generator=torch.Generator().manual_seed(0))
    astrai.save_lora(tmp_path / "run" / "adapter", lora, cfg, str(model_dir))
    tok = astrai.Tokenizer.from_pretrained(model_dir)
    astrai.save_pretrained(tmp_path / "merged", astrai.merge_lora(params, lora), cfg, tok)
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    run_eval("--model", str(model_dir), "--lora", str(tmp_path / "run"), "--data", str(data))
    adapted = json.loads((tmp_path / "run" / "adapter" / "eval.json").read_text())
    nll, count = reference_nll(tmp_path / "merged", TEXTS)
    base_nll, _ = reference_nll(model_dir, TEXTS)
    assert abs(nll - base_nll) / count > 1e-3  # the adapter moves the loss far past the rtol
    assert adapted["model"] == f"{model_dir} + {tmp_path / 'run' / 'adapter'}"
    loss = adapted["tasks"][0]["metrics"]["loss"]
    assert loss == pytest.approx(nll / count, rel=64 * torch.finfo(torch.float32).eps)


def test_bits_per_byte_by_hand(model_dir, tmp_path):
    # "héllo" is 5 characters but 6 bytes: bits per byte divides by bytes, not characters
    text = "héllo"
    data = write_jsonl(tmp_path / "one.jsonl", [{"text": text}])
    out = tmp_path / "r.json"
    run_eval("--model", str(model_dir), "--data", str(data), "--out", str(out))
    metrics = json.loads(out.read_text())["tasks"][0]["metrics"]
    nll, _ = reference_nll(model_dir, [text])
    assert metrics["bytes"] == 6
    bits = nll / math.log(2)
    assert metrics["bits_per_byte"] == pytest.approx(
        bits / 6, rel=64 * torch.finfo(torch.float32).eps
    )


def test_rolling_windows_by_hand():
    """Ten tokens after the prefix 0, windows of 4: each scores the next 4 tokens (the last
    scores what is left, after as much context as still fits in 4 model inputs)."""
    assert rolling_pairs(0, list(range(1, 11)), 4) == [
        ([0], [1, 2, 3, 4]),
        ([4], [5, 6, 7, 8]),
        ([6, 7, 8], [9, 10]),
    ]
    assert rolling_pairs(0, [1, 2], 4) == [([0], [1, 2])]


def test_rolling_windows_score_each_token_once_with_the_context_that_fits(short_model_dir):
    """Texts longer than the context: each window sees at most max_len tokens, the sum over
    windows equals scoring token by token with the same truncated context."""
    params, cfg = astrai.load_pretrained(short_model_dir)
    tok = astrai.Tokenizer.from_pretrained(short_model_dir)
    ids = tok.encode(TEXTS[2])
    assert len(ids) > 2 * cfg.max_position_embeddings
    pairs = rolling_pairs(tok.eos_id, ids, cfg.max_position_embeddings)
    assert [t for _, c in pairs for t in c] == ids
    from astrai.eval import score_pairs

    got = [lp for s in score_pairs(params, cfg, pairs, batch_size=3) for lp in s.logprobs]
    # independent check: a per-window forward with the window's own tokens
    expected = []
    for context, continuation in pairs:
        x = torch.tensor([(context + continuation)[:-1]])
        logp = F.log_softmax(astrai.forward(params, cfg, x)[0].float(), -1)
        rows = logp[-len(continuation) :]
        expected += rows.gather(-1, torch.tensor(continuation)[:, None])[:, 0].tolist()
    assert got == pytest.approx(expected, abs=1e-5)


def test_perplexity_on_a_prepared_folder_is_the_mean_loss_of_its_rows(model_dir, tmp_path):
    """A folder `just prepare` wrote: every trained token of every row, bytes those of the
    target tokens' text."""
    from astrai.config import eval_config
    from astrai.data import IGNORE, data_config, get_example, open_dataset, prepare
    from astrai.eval import evaluate_tasks, model_of

    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    cfg = data_config(
        {"tokenizer": str(model_dir), "inputs": [str(data)], "output": str(tmp_path / "shards"),
         "kind": "seq", "max_seq_len": 16, "positions": "document", "progress": False},
        "test",
    )  # fmt: skip
    prepare(cfg, log=None)
    params, model_cfg = astrai.load_pretrained(model_dir)
    tok = astrai.Tokenizer.from_pretrained(model_dir)
    task = {"name": "shards", "kind": "perplexity", "data": str(tmp_path / "shards")}
    metrics = evaluate_tasks(model_of(params, model_cfg, tok), eval_config({"tasks": [task]}))[0][
        "metrics"
    ]
    dataset = open_dataset(tmp_path / "shards")
    nll, count, nbytes = 0.0, 0, 0
    for i in range(len(dataset)):
        row = get_example(dataset, i)
        ids, labels = torch.as_tensor(row["input_ids"]), torch.as_tensor(row["labels"])
        positions, docs = (torch.as_tensor(row[k])[None] for k in ("positions", "doc_ids"))
        logits = astrai.forward(params, model_cfg, ids[None], positions, doc_ids=docs)[0].double()
        nll += F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum").item()
        targets = labels[labels != IGNORE].tolist()
        count += len(targets)
        nbytes += len(tok.decode(targets, skip_special_tokens=False).encode())
    eps = torch.finfo(torch.float32).eps
    assert metrics["tokens"] == count and metrics["bytes"] == nbytes
    assert metrics["loss"] == pytest.approx(nll / count, rel=64 * eps)
    assert metrics["bits_per_byte"] == pytest.approx(nll / math.log(2) / nbytes, rel=64 * eps)
