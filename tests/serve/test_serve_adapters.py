"""LoRA adapters over one served base model, through the official clients against a real
server: `model` picks the adapter, each adapter answers as its merged model served alone,
/v1/models lists them, POST and DELETE /v1/adapters load and unload them while serving."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
import torch
from tiny_server import (
    API_KEY,
    HELLO_Q,
    MODEL,
    WEATHER_Q,
    engine_for,
    no_end_bias,
    serving,
    wait_for,
    wait_until_idle,
)

import astrai
from astrai.config import ModelConfig, ServeConfig, to_dict
from astrai.model.lora_folder import save_lora

QUESTIONS = [HELLO_Q, WEATHER_Q]
ADAPTERS = {"alpha": (("q_proj", "v_proj"), 4, 1), "beta": (("gate_proj", "down_proj"), 2, 2)}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def random_adapter(params, cfg, targets, rank, seed):
    """A LoRA tree whose B is random too, large enough to change the greedy answers."""
    lora = astrai.init_lora(params, cfg, rank=rank, alpha=2.0 * rank, targets=targets, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for pair in lora["weights"].values():
        pair["B"] = torch.randn(pair["B"].shape, generator=generator)
    return lora


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """{name: (LoRA tree, its PEFT folder)}"""
    params, cfg, _ = tiny
    folder = tmp_path_factory.mktemp("adapters")
    trees = {name: random_adapter(params, cfg, *spec) for name, spec in ADAPTERS.items()}
    return {name: (lora, save_lora(folder / name, lora, cfg)) for name, lora in trees.items()}


@pytest.fixture(scope="module")
def server(tiny, adapters):
    targets = tuple(t for spec in ADAPTERS.values() for t in spec[0])
    with engine_for(tiny, max_batch=16, max_adapter_rank=4, adapter_targets=targets) as engine:
        for name, (_, folder) in adapters.items():
            engine.load_adapter(name, folder)
        with serving(engine, ServeConfig(api_key=API_KEY, default_max_tokens=16)) as url:
            yield url, engine


@pytest.fixture(scope="module")
def merged(tiny, adapters):
    """{adapter name: URL of a server of the base model with that adapter merged in}"""
    params, cfg, tok = tiny
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, (lora, _) in adapters.items():
            engine = stack.enter_context(engine_for((astrai.merge_lora(params, lora), cfg, tok)))
            urls[name] = stack.enter_context(serving(engine))
        yield urls


@contextlib.contextmanager
def paused(engine):
    """The engine thread held between two steps (inside `engine.call`) until the block ends."""
    holding, release = threading.Event(), threading.Event()

    def hold(params):
        holding.set()
        release.wait()

    thread = threading.Thread(target=engine.call, args=(hold,))
    thread.start()
    try:
        assert holding.wait(10)
        yield
    finally:
        release.set()
        thread.join()


def wait_until_queued(engine, n: int, timeout: float = 10.0) -> None:
    """Until n messages wait in the paused engine's inbox (a FIFO it takes in order)."""
    deadline = time.monotonic() + timeout
    while engine._inbox.qsize() < n:
        assert time.monotonic() < deadline, engine._inbox.qsize()
        time.sleep(0.01)


def openai_client(url: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def greedy_chat(url: str, model: str, question: str, key: str = API_KEY) -> str:
    answer = openai_client(url, key).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert answer.model == model
    return answer.choices[0].message.content


def test_each_adapter_answers_as_its_merged_model_in_one_batch(server, merged):
    url, _ = server
    expected = {
        (m, q): greedy_chat(merged[m], MODEL, q, "unused") for m in merged for q in QUESTIONS
    }
    expected |= {(MODEL, q): greedy_chat(url, MODEL, q) for q in QUESTIONS}
    for q in QUESTIONS:  # each adapter changes the answers: the comparison can fail
        assert len({expected[m, q] for m in [MODEL, *merged]}) == 3
    expected |= {(f"{MODEL}:alpha", q): expected["alpha", q] for q in QUESTIONS}  # SGLang's form
    asked = list(expected) * 2
    with ThreadPoolExecutor(len(asked)) as pool:  # every model at once: batches mix them
        answers = list(pool.map(lambda key: greedy_chat(url, *key), asked))
    assert answers == [expected[key] for key in asked]


def test_text_completions_and_anthropic_messages_pick_the_adapter(server, merged):
    url, _ = server
    ask = {"prompt": HELLO_Q, "max_tokens": 6, "temperature": 0}
    ours = openai_client(url).completions.create(model="beta", **ask)
    alone = openai_client(merged["beta"], "unused").completions.create(model=MODEL, **ask)
    assert ours.model == "beta" and ours.choices[0].text == alone.choices[0].text
    message = {
        "max_tokens": 8,
        "messages": [{"role": "user", "content": HELLO_Q}],
        "extra_body": {"temperature": 0},
    }
    client = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)
    ours = client.messages.create(model="alpha", **message)
    alone = anthropic.Anthropic(base_url=merged["alpha"], api_key="x", max_retries=0)
    assert ours.model == "alpha"
    assert ours.content[0].text == alone.messages.create(model=MODEL, **message).content[0].text
    assert client.messages.count_tokens(model="alpha", messages=message["messages"]).input_tokens
    base = client.messages.create(model=MODEL, **message)
    assert base.content[0].text != ours.content[0].text  # the adapter changes the answer


def test_models_list_the_base_and_its_adapters(server):
    client = openai_client(server[0])
    listed = {m.id: m for m in client.models.list().data}
    assert list(listed) == [MODEL, "alpha", "beta"]
    assert listed[MODEL].model_extra["parent"] is None
    assert listed["alpha"].model_extra["parent"] == MODEL
    assert client.models.retrieve("beta").model_extra["parent"] == MODEL
    assert client.models.retrieve(f"{MODEL}:beta").id == "beta"


def test_unknown_models_are_404_in_each_api_shape(server):
    url, _ = server
    for model in ["gpt-4", f"{MODEL}:gamma", "gamma"]:
        with pytest.raises(openai.NotFoundError) as err:
            greedy_chat(url, model, HELLO_Q)
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
        assert "alpha" in err.value.body["message"]  # it says what is served
    client = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(
            model=f"{MODEL}:gamma", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert err.value.body["error"]["type"] == "not_found_error"


def test_scoring_a_prompt_with_an_adapter_is_refused_by_name(server):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client(server[0]).completions.create(
            model="alpha", prompt=HELLO_Q, max_tokens=0, echo=True, logprobs=1
        )
    assert err.value.body["param"] == "model" and "alpha" in err.value.body["message"]


def test_adapters_load_and_unload_while_serving(server, adapters, tiny):
    url, engine = server
    post = {"name": "gamma", "path": str(adapters["alpha"][1])}
    assert httpx.post(f"{url}/v1/adapters", json=post).status_code == 401
    assert httpx.delete(f"{url}/v1/adapters/alpha").status_code == 401
    loaded = httpx.post(f"{url}/v1/adapters", json=post, headers=AUTH)
    assert loaded.status_code == 200, loaded.text
    assert (loaded.json()["id"], loaded.json()["parent"]) == ("gamma", MODEL)
    assert greedy_chat(url, "gamma", HELLO_Q) == greedy_chat(url, "alpha", HELLO_Q)
    taken = httpx.post(f"{url}/v1/adapters", json=post, headers=AUTH)
    assert taken.status_code == 409 and taken.json()["error"]["param"] == "name"

    ask = {"model": "gamma", "messages": [{"role": "user", "content": HELLO_Q}],
           "max_tokens": 400, "stream": True, "logit_bias": no_end_bias(tiny[2])}  # fmt: skip
    with ThreadPoolExecutor(1) as pool, contextlib.ExitStack() as streams:
        with paused(engine):  # what is sent now is taken in order once it resumes
            stream = streams.enter_context(
                httpx.stream("POST", f"{url}/v1/chat/completions", json=ask, headers=AUTH)
            )
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
            assert "assistant" in next(lines)  # the role chunk: the request is in the inbox
            delete = pool.submit(httpx.delete, f"{url}/v1/adapters/gamma", headers=AUTH)
            wait_until_queued(engine, 2)  # the request, then the unload
        busy = delete.result()
        assert "delta" in next(line for line in lines if line)  # it went on running
    assert busy.status_code == 409 and "gamma" in busy.json()["error"]["message"]
    wait_until_idle(engine)
    gone = httpx.delete(f"{url}/v1/adapters/gamma", headers=AUTH)
    assert gone.status_code == 200 and gone.json() == {
        "id": "gamma",
        "object": "adapter",
        "deleted": True,
    }
    with pytest.raises(openai.NotFoundError):
        greedy_chat(url, "gamma", HELLO_Q)
    again = httpx.delete(f"{url}/v1/adapters/gamma", headers=AUTH)
    assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
    assert "No adapter `gamma`" in again.json()["error"]["message"]
    wait_for(engine, "running", 0)


def test_folders_and_names_that_do_not_fit_are_refused_by_field(server, tiny, tmp_path):
    url, _ = server
    cfg = tiny[1]
    wider = ModelConfig(**{**to_dict(cfg), "hidden_size": 64})
    other = random_adapter(astrai.init_params(wider, seed=0), wider, ("q_proj",), 4, 3)
    cases = [
        ({"name": "delta", "path": str(tmp_path / "missing")}, "path", "adapter_config.json"),
        ({"name": "delta", "path": str(save_lora(tmp_path / "w", other, wider))}, "path", "q_proj"),
        ({"name": f"{MODEL}:x", "path": str(tmp_path)}, "name", "adapter name"),
        ({"name": MODEL, "path": str(tmp_path)}, "name", "base model"),
        ({"name": "delta"}, "path", "path"),
    ]
    for body, field, words in cases:
        refused = httpx.post(f"{url}/v1/adapters", json=body, headers=AUTH)
        assert refused.status_code == 400, (body, refused.text)
        error = refused.json()["error"]
        assert error["param"] == field and words in error["message"], (body, error)
    names = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]]
    assert names == [MODEL, "alpha", "beta"]
