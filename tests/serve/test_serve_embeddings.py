"""POST /v1/embeddings for an encoder model, through the official `openai` client."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import openai
import pytest
import torch
from thread_names import thread_names
from tiny_server import MODEL, serving

import astrai
from astrai.config import ModelConfig
from astrai.infer.hardware import _openmp, name_native_thread
from astrai.serve import EncoderModel
from astrai.serve.embeddings import embed_batch
from astrai.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def encoder():
    tok = Tokenizer.train(["an encoder reads the whole sentence at once"] * 4, vocab_size=300)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        model_type="encoder",
    )
    return EncoderModel(astrai.init_params(cfg, seed=0), cfg, tok)


@pytest.fixture(scope="module")
def client(encoder):
    with serving(encoder) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def test_embeddings_match_encode(client, encoder):
    texts = ["an encoder", "reads the whole sentence at once"]
    r = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64
    assert [d.index for d in r.data] == [0, 1]
    vectors = [d.embedding for d in r.data]
    assert all(
        len(v) == 32 and math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in vectors
    )
    for text, vector in zip(texts, vectors):
        ids = torch.tensor([encoder.tokenizer.encode(text)])
        expected = astrai.encode(encoder.params, encoder.cfg, ids)[0]
        assert torch.allclose(torch.tensor(vector), expected, atol=1e-5)
    assert r.usage.prompt_tokens == sum(len(encoder.tokenizer.encode(t)) for t in texts)


def test_float_format_token_ids_and_dimensions(client):
    r = client.embeddings.create(
        model=MODEL, input=[[5, 6, 7]], encoding_format="float", dimensions=8
    )
    (vector,) = [d.embedding for d in r.data]
    assert len(vector) == 8 and math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-4)


def test_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input="x " * 200)
    assert err.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input="x", dimensions=64)
    assert err.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "encoder" in err.value.body["message"]


@pytest.mark.skipif(
    _openmp() is None or not Path("/proc/self/task").is_dir(),
    reason="ends OpenMP teams through torch's libgomp; counts threads in /proc",
)
def test_a_batch_leaves_no_openmp_team_on_its_worker_thread(encoder):
    """Each request runs on one of anyio's worker threads, not always the same: a team left
    idle on each would make every later batch wake its own through the kernel."""
    big, name, counts = torch.rand(1 << 20), "team-embedder", {}

    def batch_on_a_new_thread():
        name_native_thread(name)  # its team's threads carry the name
        big.sum()
        counts["with its team"] = thread_names().count(name)
        embed_batch(encoder, [[5, 6, 7]])
        counts["after"] = thread_names().count(name)

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of two: one thread more
    try:
        worker = threading.Thread(target=batch_on_a_new_thread)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(before)
    assert counts == {"with its team": 2, "after": 1}
