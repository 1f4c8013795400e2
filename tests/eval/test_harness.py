"""/v1/completions scores prompts as lm-evaluation-harness's `local-completions` model needs
(`echo` with `logprobs`, `max_tokens: 0`, batched prompts), checked against `forward` through
a real `programs/serve.py` process; then the harness itself evaluates that server on locally
defined tasks, without the network."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from eval_fixtures import TEXTS, tiny_model

import astrai

ROOT = Path(__file__).resolve().parents[2]
NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base url, model folder) of a served tiny model."""
    model = tiny_model(tmp_path_factory.mktemp("served"))
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, ROOT / "programs" / "serve.py", "--model", str(model),
         "--model-name", NAME, "--port", str(port), "--log-level", "warning"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                if time.time() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.3)
        yield url, model
    finally:
        server.terminate()
        server.wait(timeout=30)


def forward_logprobs(model_dir, ids):
    """log p(ids[k] | ids[:k]) for k >= 1, from `forward`."""
    params, cfg = astrai.load_pretrained(model_dir)
    logits = astrai.forward(params, cfg, torch.tensor([ids]))[0, :-1]
    logp = F.log_softmax(logits.double(), -1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), logp.argmax(-1).tolist()


def test_echo_returns_the_prompt_log_probabilities_of_forward(served):
    url, model_dir = served
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    tok = astrai.Tokenizer.from_pretrained(model_dir)
    texts = TEXTS[:3]
    reply = client.completions.create(
        model=NAME, prompt=texts, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert len(reply.choices) == 3
    for choice, text in zip(sorted(reply.choices, key=lambda c: c.index), texts):
        ids = tok.encode(text)
        expected, argmax = forward_logprobs(model_dir, ids)
        lp = choice.logprobs
        assert choice.text == text and choice.finish_reason == "length"
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        assert "".join(lp.tokens) == text
        for k, top in enumerate(lp.top_logprobs[1:]):
            (best,) = top.values()
            assert best >= lp.token_logprobs[k + 1] - 1e-6
            assert (best == pytest.approx(lp.token_logprobs[k + 1])) == (argmax[k] == ids[k + 1])
    # token ids in, with one generated token after the echoed prompt (what the harness sends)
    ids = tok.encode(TEXTS[0])
    reply = client.completions.create(
        model=NAME, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    lp = reply.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(
        forward_logprobs(model_dir, ids)[0], abs=1e-4
    )


def test_scoring_requests_that_cannot_be_answered_say_why(served):
    url, _ = served
    base = {"model": NAME, "prompt": "the cat"}
    r = httpx.post(f"{url}/v1/completions", json={**base, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(
        f"{url}/v1/completions",
        json={**base, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


# --- lm-evaluation-harness -----------------------------------------------------------------------

CHOICE_TASK = """task: astrai_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""

GENERATION_TASK = """task: astrai_generation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<|endoftext|>"]
  max_gen_toks: 4
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def run_harness(url: str, model_dir: Path, tasks: Path, out: Path) -> subprocess.CompletedProcess:
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HOME": str(out / "hf-home"), "HF_ALLOW_CODE_EVAL": "0"}  # fmt: skip
    command = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions",
        "--model_args",
        f"model={NAME},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={model_dir},max_length=64",
        "--include_path", str(tasks), "--tasks", "astrai_choice,astrai_generation",
        "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, **offline}
    )


def arguments(sample: dict) -> list[tuple]:
    """The (context, continuation) strings of a logged sample's requests."""
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}}
        args = [tuple(a.values()) for a in args.values()]
    return [tuple(a[:2]) for a in args]


def harness_split(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, all ids) as the harness tokenises a request: the context's trailing
    spaces move to the continuation, and the whole text is tokenised at once."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    return tok.encode(context), tok.encode(context + continuation)


def test_lm_evaluation_harness_scores_the_server_like_forward(served, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -e '.[harness]'")
    url, model_dir = served
    choice = [
        {"prompt": "the cat sat on the", "choices": [" mat", " twelve"], "answer": 0},
        {"prompt": "twelve plus thirty is", "choices": [" 42", " héllo wörld"], "answer": 1},
    ]
    tok = astrai.Tokenizer.from_pretrained(model_dir)
    gen = [{"prompt": "the cat", "answer": "never"}, {"prompt": "a longer", "answer": "x"}]
    (tmp_path / "choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in choice))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gen))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "choice.yaml").write_text(CHOICE_TASK.format(data=tmp_path / "choice.jsonl"))
    (tasks / "generation.yaml").write_text(GENERATION_TASK.format(data=tmp_path / "gen.jsonl"))
    result = run_harness(url, model_dir, tasks, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-4000:]

    samples = {
        p.name.split("_20")[0]: [json.loads(line) for line in p.read_text().splitlines()]
        for p in (tmp_path / "out").rglob("samples_*.jsonl")
    }
    logged = samples["samples_astrai_choice"]
    assert len(logged) == len(choice)
    for sample in logged:
        for (context, continuation), resp in zip(arguments(sample), sample["resps"]):
            loglik, _greedy = resp[0]
            head, ids = harness_split(tok, context, continuation)
            ours = sum(forward_logprobs(model_dir, ids)[0][len(head) - 1 :])
            assert float(loglik) == pytest.approx(ours, abs=1e-4)
    generated = samples["samples_astrai_generation"]
    assert len(generated) == len(gen)
    for sample in generated:
        ids = tok.encode(gen[sample["doc_id"]]["prompt"])
        params, cfg = astrai.load_pretrained(model_dir)
        with astrai.Engine(params, cfg, tok) as engine:
            (want,) = engine.generate([ids], temperature=0.0, max_tokens=4)
        assert sample["resps"][0][0] == want.text
