"""Choice and generation tasks on tiny data: the picks and scores they report are those
worked out here from `forward` and from the scoring rules."""

import json

import msgspec
import pytest
import tokenizers
import torch
import torch.nn.functional as F
from tokenizers import decoders, models, pre_tokenizers

import astrai
from astrai.config import ConfigError, EvalTask, eval_config, load_eval_config
from astrai.eval import evaluate_tasks, model_of, pass_at_k, scorer_for
from astrai.eval.scoring import RewardError
from astrai.eval.tasks import continuation_pair, score_generations


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def load(model_dir):
    params, cfg = astrai.load_pretrained(model_dir)
    return model_of(params, cfg, astrai.Tokenizer.from_pretrained(model_dir))


def option_logprob(model, ctx: list[int], cont: list[int]):
    logits = astrai.forward(model.params, model.cfg, torch.tensor([ctx + cont]))[0, :-1]
    logp = F.log_softmax(logits.float(), -1)[len(ctx) - 1 :]
    return logp.gather(-1, torch.tensor(cont)[:, None]).sum().item(), len(cont)


def test_choice_picks_the_most_likely_option_three_ways(model_dir, tmp_path):
    model = load(model_dir)
    records = [
        {"prompt": "the cat sat on the", "choices": [" mat", " twelve", " héllo wörld"], "answer": 0},
        {"prompt": "twelve plus thirty is", "choices": [" 42", " the cat", " 1234"], "answer": 2},
        {"prompt": "a longer line ", "choices": ["of text", "of", "with commas and digits"], "answer": 1},
    ]  # fmt: skip
    data = write_jsonl(tmp_path / "choice.jsonl", records)
    cfg = eval_config({"tasks": [{"name": "mc", "kind": "choice", "data": data}], "batch_size": 2})
    metrics = evaluate_tasks(model, cfg)[0]["metrics"]
    expected = {"accuracy": 0, "accuracy_per_token": 0, "accuracy_per_byte": 0}
    encode = model.tokenizer.encode
    for r in records:
        # The byte-level pre-tokenizer splits before a space that starts a word, so no token
        # spans the boundary once the prompt's trailing space has moved to the option.
        prompt = r["prompt"].rstrip()
        moved = r["prompt"][len(prompt) :]
        scores = [option_logprob(model, encode(prompt), encode(moved + o)) for o in r["choices"]]
        sums = [s for s, _ in scores]
        per_token = [s / n for s, n in scores]
        per_byte = [s / len(o.encode()) for (s, _), o in zip(scores, r["choices"])]
        for name, values in zip(expected, (sums, per_token, per_byte)):
            expected[name] += values.index(max(values)) == r["answer"]
    assert metrics == {**{k: v / len(records) for k, v in expected.items()}, "records": 3}


def hand_made_tokenizer() -> astrai.Tokenizer:
    """Byte-level BPE whose merges are written here: "the", " cat", " ca", " sat"."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    merges = [("t", "h"), ("th", "e"), ("Ġ", "c"), ("Ġc", "a"), ("Ġca", "t"), ("Ġ", "s"),
              ("Ġs", "a"), ("Ġsa", "t")]  # fmt: skip
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>"])
    return astrai.Tokenizer(backend, eos_token="<|endoftext|>")


@pytest.mark.parametrize(
    ("context", "continuation", "tokens"),
    [
        ("the", " cat sat", (["the"], ["Ġcat", "Ġsat"])),
        # trailing spaces go with the continuation, as they tokenise in the whole text
        ("the ", "cat", (["the"], ["Ġcat"])),
        ("the  ", "cat", (["the"], ["Ġ", "Ġcat"])),
        # " ca" + "t" is one token " cat" in the whole text: it belongs to the continuation
        ("the ca", "t sat", (["the"], ["Ġcat", "Ġsat"])),
        ("the c", "at", (["the"], ["Ġcat"])),
        # an empty context is the end-of-text token
        ("", "the cat", (["<|endoftext|>"], ["the", "Ġcat"])),
    ],
)
def test_continuation_pair_splits_as_the_whole_text_tokenises(context, continuation, tokens):
    tok = hand_made_tokenizer()
    ctx, cont = continuation_pair(tok, context, continuation)
    assert (
        [tok.backend.id_to_token(i) for i in ctx],
        [tok.backend.id_to_token(i) for i in cont],
    ) == tokens


def greedy(model, prompt, max_tokens):
    """Greedy decoding by hand with `forward`, stopping at the tokenizer's stop tokens."""
    ids = model.tokenizer.encode(prompt)
    out = []
    for _ in range(max_tokens):
        nxt = int(
            astrai.forward(model.params, model.cfg, torch.tensor([ids + out]))[0, -1].argmax()
        )
        if nxt in model.tokenizer.stop_ids:
            break
        out.append(nxt)
    return model.tokenizer.decode(out)


def test_generation_scores_engine_completions_exactly(model_dir, tmp_path):
    model = load(model_dir)
    prompts = ["the cat", "twelve plus", "a longer", "héllo"]
    wanted = [greedy(model, p, 5) for p in prompts]
    # two references are what greedy decoding writes, two are not
    answers = [wanted[0], "not this", wanted[2], wanted[3] + "x"]
    data = write_jsonl(
        tmp_path / "gen.jsonl", [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)]
    )
    task = {"name": "gen", "kind": "generation", "data": data, "chat": False, "max_tokens": 5}
    result = evaluate_tasks(model, eval_config({"tasks": [task], "batch_size": 3}))[0]
    assert result["metrics"]["accuracy"] == 0.5
    assert result["metrics"]["examples"][0]["completion"] == wanted[0]


def test_pass_at_k_with_several_samples(model_dir, tmp_path):
    """Three samples of two prompts through the Engine: top_k = 1 makes each sample the greedy
    completion, so the first prompt's three are right and the second's three wrong."""
    model = load(model_dir)
    right = greedy(model, "the cat", 3)
    records = [{"prompt": "the cat", "answer": right}, {"prompt": "a longer", "answer": "never"}]
    data = write_jsonl(tmp_path / "p.jsonl", records)
    task = {"name": "s", "kind": "generation", "data": data, "chat": False, "samples": 3,
            "temperature": 1.0, "top_k": 1, "max_tokens": 3}  # fmt: skip
    metrics = evaluate_tasks(model, eval_config({"tasks": [task]}))[0]["metrics"]
    assert metrics["pass@1"] == metrics["pass@3"] == metrics["accuracy"] == 0.5


def test_pass_at_k_counts_the_right_samples_of_each_record():
    """Records with 2, 0 and 3 right of 3 samples: pass@1 is the mean fraction right,
    (2/3 + 0 + 1) / 3; pass@3 the fraction of records with any right, 2/3."""
    task = EvalTask(name="t", kind="generation", data="x", samples=3, temperature=1.0)
    records = [{"answer": "42"}, {"answer": "42"}, {"answer": "7"}]
    completions = [["42", "41", "42"], ["no", "4", "2"], ["7", "7", "7"]]
    metrics = score_generations(task, records, ["p"] * 3, completions)
    assert metrics["pass@1"] == pytest.approx(5 / 9)
    assert metrics["pass@3"] == pytest.approx(2 / 3)
    assert metrics["accuracy"] == pytest.approx(5 / 9)
    assert [e["score"] for e in metrics["examples"]] == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 0, 1, 0.0),
        (5, 2, 1, 0.4),  # c / n
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0),  # fewer than k wrong samples: any k hold a right one
        (5, 2, 5, 1.0),
        (5, 5, 3, 1.0),
        (10, 3, 3, 1 - 35 / 120),  # 1 - C(7,3)/C(10,3)
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (2, 1, 1, 0.5),
    ],
)
def test_pass_at_k_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12)


def scores(score, completions, answers, pattern=""):
    task = EvalTask(name="t", kind="generation", data="x", score=score, pattern=pattern)
    return scorer_for(task)(["p"] * len(completions), completions, answer=answers)


def test_scorers():
    assert scores("exact", [" 42\n", "42.0"], ["42", "42"]) == [1.0, 0.0]
    assert scores("numeric", ["so 4 + 38 = 42.0", "it is 41", "none"], ["42", "41", "1"]) == [
        1.0,
        1.0,
        0.0,
    ]
    assert scores("regex", ["so 1 + 2 = 3", "3"], ["1 + 2 = 3", "3"], pattern=r"so (.*)$") == [
        1.0,
        0.0,
    ]
    got = scores("astrai.train.rewards.exact_match", ["1 + 1 = 2", "1 + 1 = 3"], ["2", "2"])
    assert got == [1.0, 0.0]


def nan_scores(prompts, completions, **fields):
    return [float("nan")] * len(completions)


def test_a_scorer_is_called_as_grpo_calls_a_reward():
    # A record field named like a reward function's own argument does not clash with it.
    records = [{"prompt": "1 + 1", "answer": "2", "completions": "a field of the data"}]
    task = EvalTask(name="t", kind="generation", data="x", score="exact")
    assert score_generations(task, records, ["1 + 1"], [["2"]])["accuracy"] == 1.0
    # A scorer that gives no finite score per completion is named, with its task.
    bad = msgspec.structs.replace(task, score="test_tasks.nan_scores")
    with pytest.raises(RewardError, match=r"test_tasks.nan_scores \(task 't'\).*non-finite"):
        score_generations(bad, records, ["1 + 1"], [["2"]])
    missing = msgspec.structs.replace(task, answer_key="solution")
    with pytest.raises(RewardError, match=r"exact \(task 't'\).*no 'solution' \(answer_key\)"):
        score_generations(missing, records, ["1 + 1"], [["2"]])


def test_bad_config_names_the_key_and_the_file(tmp_path):
    toml = tmp_path / "eval.toml"
    toml.write_text(
        '[eval]\n[[eval.tasks]]\nname = "a"\nkind = "generation"\ndata = "d"\ntemperature = -1\n'
    )
    with pytest.raises(ConfigError, match=r"eval.toml \[eval\].*temperature.*tasks\[0\]"):
        load_eval_config(toml)
    toml.write_text('[eval]\n[[eval.tasks]]\nname = "a"\nkind = "guess"\ndata = "d"\n')
    with pytest.raises(ConfigError, match=r"eval.toml \[eval\].*tasks\[0\].kind"):
        load_eval_config(toml)
    toml.write_text(
        '[eval]\nmodel = "m"\n[[eval.tasks]]\nname = "a"\nkind = "choice"\ndata = "d.jsonl"\n'
    )
    cfg = load_eval_config(toml)
    assert cfg.tasks[0].data == str(tmp_path / "d.jsonl") and cfg.model == str(tmp_path / "m")
    assert msgspec.to_builtins(cfg)["batch_size"] == 16


def test_a_bad_record_names_file_and_line(model_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": \n')
    cfg = eval_config({"tasks": [{"name": "p", "kind": "perplexity", "data": str(path)}]})
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        evaluate_tasks(load(model_dir), cfg)
