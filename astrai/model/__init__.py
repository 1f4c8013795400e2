"""The model: parameters as a flat dict of tensors, layers as functions."""

from astrai.model.attention import kv_shapes
from astrai.model.checkpoint import CheckpointError, check_params, load_pretrained, save_pretrained
from astrai.model.forward import (
    decode_layers,
    embed,
    encode,
    forward,
    forward_cached,
    hidden_states,
    init_cache,
    lm_head,
)
from astrai.model.hf_config import model_config_from_json
from astrai.model.logprobs import IGNORE, token_logps
from astrai.model.lora import init_lora, merge_lora
from astrai.model.lora_folder import AdapterError, load_lora, save_lora
from astrai.model.params import (
    DTYPES,
    Matrix,
    Params,
    canonical_order,
    init_params,
    param_shapes,
)
from astrai.model.rope import apply_rope, rope_tables

__all__ = [
    "DTYPES",
    "IGNORE",
    "AdapterError",
    "CheckpointError",
    "Matrix",
    "Params",
    "apply_rope",
    "canonical_order",
    "check_params",
    "decode_layers",
    "embed",
    "encode",
    "forward",
    "forward_cached",
    "hidden_states",
    "init_cache",
    "init_lora",
    "init_params",
    "kv_shapes",
    "lm_head",
    "load_lora",
    "load_pretrained",
    "merge_lora",
    "model_config_from_json",
    "param_shapes",
    "rope_tables",
    "save_lora",
    "save_pretrained",
    "token_logps",
]
