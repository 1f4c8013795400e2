"""AstrAI: train and serve your own language model with plain pytrees and pure functions.

    import astrai as ai
    params = ai.init_params(cfg, seed=0)
    logits = ai.forward(params, cfg, tokens)

The names below are the stable public surface; everything else is reachable through the
subpackages (astrai.model, astrai.data, astrai.train, astrai.infer, astrai.serve).
"""

from astrai.config import ConfigError, EngineConfig, ModelConfig, ServeConfig, TrainConfig
from astrai.infer import (
    Completion,
    DonatedError,
    Engine,
    Request,
    SamplingParams,
    StreamEvent,
    add_request,
    alloc_pages,
    cancel_request,
    decode_step,
    engine_step,
    free_pages,
    init_engine,
    init_pages,
    prefill,
    prepare_params,
    run_requests,
    sample,
    share_pages,
)
from astrai.model import (
    CheckpointError,
    encode,
    forward,
    forward_cached,
    init_cache,
    init_lora,
    init_params,
    load_lora,
    load_pretrained,
    merge_lora,
    save_lora,
    save_pretrained,
)
from astrai.tokenizer import Tokenizer
from astrai.train import TrainState, init_train_state, loss_fn, train, train_step

__all__ = [
    "CheckpointError",
    "Completion",
    "ConfigError",
    "DonatedError",
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "Request",
    "SamplingParams",
    "ServeConfig",
    "StreamEvent",
    "Tokenizer",
    "TrainConfig",
    "TrainState",
    "add_request",
    "alloc_pages",
    "cancel_request",
    "decode_step",
    "encode",
    "engine_step",
    "forward",
    "forward_cached",
    "free_pages",
    "init_cache",
    "init_engine",
    "init_lora",
    "init_pages",
    "init_params",
    "init_train_state",
    "load_lora",
    "load_pretrained",
    "loss_fn",
    "merge_lora",
    "prefill",
    "prepare_params",
    "run_requests",
    "sample",
    "save_lora",
    "save_pretrained",
    "share_pages",
    "train",
    "train_step",
]
