"""POST /v1/embeddings for encoder models (cfg.model_type == "encoder").

An encoder needs no engine: `EncoderModel` is the data the route reads, and each request is one
padded batch through `astrai.encode`, run on a worker thread so the event loop stays free. The
worker may differ from one request to the next, so each leaves no OpenMP team behind on its
thread (docs/inference.md, "One compute thread").
"""

from __future__ import annotations

import base64
import threading

import anyio
import msgspec
import torch
from starlette.responses import Response

from astrai.infer.hardware import release_thread_team
from astrai.model import encode
from astrai.serve.bodies import decode_body, json_response
from astrai.serve.chat import prompt_ids
from astrai.serve.errors import bad_request
from astrai.serve.schemas_openai import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage
from astrai.serve.state import AppState, check_model

_decoder = msgspec.json.Decoder(EmbeddingRequest)


class EncoderModel(msgspec.Struct, frozen=True):
    params: dict
    cfg: object  # ModelConfig with model_type "encoder"
    tokenizer: object
    device: str = "cpu"
    # one batch at a time: parallel forwards on the same cores only slow each other down
    lock: threading.Lock = msgspec.field(default_factory=threading.Lock)

    def stats(self) -> dict:
        return {"model_type": "encoder", "running": 0, "waiting": 0}

    def close(self) -> None:
        pass


def embed_batch(model: EncoderModel, batch: list[list[int]]) -> torch.Tensor:
    """Token id lists -> [B, hidden] normalised mean-pooled embeddings."""
    width = max(len(ids) for ids in batch)
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, ids in enumerate(batch):
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[row, : len(ids)] = True
    with model.lock, torch.no_grad():
        try:
            out = encode(model.params, model.cfg, tokens.to(model.device), mask.to(model.device))
            return out.float().cpu()
        finally:
            release_thread_team()


def shorten(vectors: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """Keep the first `dimensions` components and renormalise (Matryoshka style)."""
    if dimensions is None:
        return vectors
    if dimensions > vectors.shape[-1]:
        raise bad_request(
            f"dimensions is {dimensions}; this model's embeddings have {vectors.shape[-1]}.",
            "dimensions",
        )
    return torch.nn.functional.normalize(vectors[:, :dimensions], dim=-1)


def as_base64(vector: torch.Tensor) -> str:
    return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()


async def embeddings(state: AppState, body: bytes) -> Response:
    req = decode_body(_decoder, body)
    check_model(state, req.model)
    if not isinstance(state.engine, EncoderModel):
        raise bad_request(
            f"`{state.model_name}` is a decoder; embeddings need an encoder model.", "model"
        )
    batch = prompt_ids(state.tokenizer, req.input, state.vocab_size, "input")
    if len(batch) > state.serve_cfg.max_batch:
        raise bad_request(f"input holds {len(batch)} items; at most {state.serve_cfg.max_batch}.")
    longest = max(len(ids) for ids in batch)
    if longest > state.context:
        raise bad_request(f"An input is {longest} tokens; at most {state.context}.", "input")
    if longest == 0:
        raise bad_request("An input is empty.", "input")
    vectors = shorten(
        await anyio.to_thread.run_sync(embed_batch, state.engine, batch), req.dimensions
    )
    as_data = as_base64 if req.encoding_format == "base64" else lambda v: v.tolist()
    data = [Embedding(i, as_data(v)) for i, v in enumerate(vectors)]
    n = sum(len(ids) for ids in batch)
    result = EmbeddingList(data, state.model_name, EmbeddingUsage(n, n))
    return json_response(result)
