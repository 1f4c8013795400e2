"""The demo pipeline end to end at a tiny size: data -> tokenizer -> pretrain -> SFT -> serve."""

import itertools
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_demo(run_dir: Path, *extra: str) -> str:
    result = subprocess.run(
        [sys.executable, ROOT / "programs" / "demo.py", "--quick", "--no-serve",
         "--run-dir", str(run_dir), *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_demo_data_is_deterministic_and_holds_out_the_evaluation(tmp_path):
    sys.path.insert(0, str(ROOT / "programs"))
    import demo_data

    demo_data.generate(tmp_path / "a", seed=3, records=300, eval_count=50)
    demo_data.generate(tmp_path / "b", seed=3, records=300, eval_count=50)
    for name in ("pretrain", "sft", "grpo", "eval"):
        assert (tmp_path / "a" / f"{name}.jsonl").read_bytes() == (
            tmp_path / "b" / f"{name}.jsonl"
        ).read_bytes()
    lines = (tmp_path / "a" / "eval.jsonl").read_text().splitlines()
    held_out = {json.loads(line)["expected"] for line in lines}
    training = "".join((tmp_path / "a" / f"{n}.jsonl").read_text() for n in ("pretrain", "sft"))
    assert len(held_out) == 50
    assert not held_out & set(re.findall(r"\d+ [+-] \d+ = \d+", training))


def test_every_pretraining_answer_follows_a_question_naming_its_operands(tmp_path):
    # the model must learn to find the operands in the question, not only to add columns
    sys.path.insert(0, str(ROOT / "programs"))
    import demo_data

    demo_data.generate(tmp_path, seed=1, records=200, eval_count=20)
    texts = [json.loads(line)["text"] for line in (tmp_path / "pretrain.jsonl").open()]
    answers = 0
    for text in texts:
        lines = text.splitlines()
        for before, line in itertools.pairwise(lines):
            if (worked := re.search(r"so (\d+) [+-] (\d+) = \d+$", line)) is not None:
                answers += 1
                assert set(worked.groups()) <= set(re.findall(r"\d+", before)), (before, line)
    assert answers == 200 * 9 // 10 + 2 * 200  # the dialogues' problems and two per drill


@pytest.mark.slow
def test_demo_trains_evaluates_and_serves_an_openai_request(tmp_path):
    openai = pytest.importorskip("openai")
    out = run_demo(tmp_path)
    for stage in ("data", "tokenizer", "prepare", "pretrain", "sft", "evaluate"):
        assert f"[demo] {stage}" in out
    assert_just_eval_reproduces_the_demo(tmp_path, out)
    model = tmp_path / "model"
    assert (model / "model.safetensors").exists() and (model / "tokenizer.json").exists()
    assert "reusing" in run_demo(tmp_path)  # a second run does not train again

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, ROOT / "programs" / "serve.py", "--model", str(model),
         "--port", str(port), "--log-level", "warning"],
    )  # fmt: skip
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        (served,) = client.models.list().data
        reply = client.chat.completions.create(
            model=served.id,
            messages=[{"role": "user", "content": "What is 12 + 30?"}],
            max_tokens=8,
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens > 0
    finally:
        server.terminate()
        server.wait(timeout=30)


def assert_just_eval_reproduces_the_demo(run_dir: Path, demo_out: str) -> None:
    """`just eval` on configs/demo-eval.toml (moved to the run folder, cut to the quick demo's
    20 records) gives the held-out accuracy the demo printed, and a held-out perplexity."""
    text = (ROOT / "configs" / "demo-eval.toml").read_text()
    text = text.replace('"../runs/demo', f'"{run_dir}').replace(
        "max_tokens", "limit = 20\nmax_tokens"
    )
    text = text.replace('kind = "perplexity"', 'kind = "perplexity"\nlimit = 20')
    config = run_dir / "eval.toml"
    config.write_text(text)
    out = run_dir / "again.json"
    result = subprocess.run(
        [sys.executable, ROOT / "programs" / "eval.py", str(config), "--out", str(out), "--quiet"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    generated, held_out = (t["metrics"] for t in json.loads(out.read_text())["tasks"])
    printed = re.search(r"exact match ([\d.]+)% on (\d+) held-out", demo_out)
    assert printed.group(1) == f"{generated['accuracy'] * 100:.1f}"
    assert int(printed.group(2)) == generated["records"] == 20
    assert f"perplexity {held_out['perplexity']:.3f}" in demo_out
    demo_results = json.loads((run_dir / "eval.json").read_text())["tasks"]
    assert demo_results[0]["metrics"]["accuracy"] == generated["accuracy"]


def test_demo_prints_the_chat_page_next_to_the_curl_example(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "programs"))
    import demo

    execs = []
    monkeypatch.setattr(demo.os, "execv", lambda path, argv: execs.append(argv))
    demo.serve(Path("runs/demo/model"), 8123)
    out = capsys.readouterr().out
    assert "browser at http://127.0.0.1:8123/ " in out and "curl http://127.0.0.1:8123/v1/" in out
    (argv,) = execs
    assert argv[1].endswith("serve.py") and argv[argv.index("--port") + 1] == "8123"
