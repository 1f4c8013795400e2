"""An engine's settings with every size resolved: the dtype, max_seq_len and the pool's pages,
from the model, the weights and the hardware."""

from __future__ import annotations

import logging
import math

import msgspec
import torch

from astrai.config import EngineConfig, ModelConfig, engine_config, from_dict, to_dict
from astrai.infer.hardware import auto_dtype, describe_dtype_choice
from astrai.infer.pages import pages_for
from astrai.model import DTYPES, kv_shapes

log = logging.getLogger("astrai.infer")


def default_num_pages(cfg: ModelConfig, config: EngineConfig, width: int, dtype) -> int:
    """Room for max_batch full-length sequences of `width` pages, capped at max_pool_bytes of
    K/V (but never less than one full-length sequence)."""
    k_shape, v_shape = kv_shapes(cfg)
    per_token = cfg.num_hidden_layers * (math.prod(k_shape) + math.prod(v_shape))
    page_bytes = per_token * config.page_size * torch.empty((), dtype=dtype).element_size()
    return max(width, min(config.max_batch * width, config.max_pool_bytes // page_bytes))


def resolve_config(cfg: ModelConfig, config: EngineConfig, params) -> EngineConfig:
    """config with its None sizes filled in: dtype from the weights ("auto" from the hardware,
    see astrai.infer.hardware), max_seq_len from the model, num_pages from the memory rule
    above."""
    dtype = config.dtype or str(next(iter(params.values())).dtype).removeprefix("torch.")
    if dtype == "auto":
        dtype = auto_dtype(config.device)
        log.info(describe_dtype_choice(config.device))
    max_seq_len = config.max_seq_len or cfg.max_position_embeddings
    num_pages = config.num_pages or default_num_pages(
        cfg, config, pages_for(max_seq_len, config.page_size), DTYPES[dtype]
    )
    return msgspec.structs.replace(
        config, dtype=dtype, max_seq_len=max_seq_len, num_pages=num_pages
    )


def engine_settings(
    cfg: ModelConfig, params, config: EngineConfig | None, settings: dict
) -> EngineConfig:
    """The resolved EngineConfig of `config` and keyword `settings` (which win); torch dtypes
    and devices are taken as their names."""
    if isinstance(settings.get("dtype"), torch.dtype):  # torch.bfloat16 -> "bfloat16"
        settings = {**settings, "dtype": str(settings["dtype"]).removeprefix("torch.")}
    if isinstance(settings.get("device"), torch.device):
        settings = {**settings, "device": str(settings["device"])}
    given = to_dict(engine_config(config)) if config is not None else {}
    merged = from_dict(EngineConfig, {**given, **settings}, "engine settings")
    return resolve_config(cfg, merged, params)


def params_for(config: EngineConfig, params: dict) -> dict:
    """The weights on the engine's device, in its dtype (a no-op when they already are)."""
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    return {k: v.to(device=device, dtype=dtype) for k, v in params.items()}
