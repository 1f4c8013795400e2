"""Configuration as data: frozen msgspec Structs, read from TOML or config.json.

Every Struct is validated when it is decoded: an unknown key, a wrong type or an inconsistent
value raises `ConfigError` naming the key and the file it came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec
import tomllib


class ConfigError(ValueError):
    """A configuration file or value is wrong; the message names the key and the file."""


class RopeScaling(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """RoPE context extension, as Hugging Face writes it in config.json."""

    rope_type: Literal["default", "linear", "dynamic", "yarn", "llama3"] = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The shape of a model. Field names follow Hugging Face config.json."""

    vocab_size: int = 32000
    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None  # None: same as num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    intermediate_size: int = 1408
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    use_qk_norm: bool = False
    use_gated_attention: bool = False
    initializer_range: float = 0.02
    # multi-latent attention (DeepSeek-V2 style)
    attn_type: Literal["gqa", "mla"] = "gqa"
    kv_lora_rank: int = 64
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    # mixture of experts (DeepSeek style)
    ffn_type: Literal["mlp", "moe"] = "mlp"
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 256
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    first_k_dense_replace: int = 0
    router_aux_loss_coef: float = 0.01
    # "decoder" is causal; "encoder" attends both ways and is used through `encode`
    model_type: Literal["decoder", "encoder"] = "decoder"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) unless head_dim is given"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_key_value_heads ({self.kv_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.attn_type == "gqa" and self.dim_per_head % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.dim_per_head}")
        if self.attn_type == "mla" and self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.ffn_type == "moe" and not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"1..n_routed_experts ({self.n_routed_experts})"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.ffn_type == "moe"
            and i >= self.first_k_dense_replace
            and i % self.decoder_sparse_step == 0
        )


def _error_for(exc: msgspec.ValidationError, source: str) -> ConfigError:
    # msgspec says "... - at `$.model.hidden_size`"; turn the path into the key people wrote.
    text = str(exc).replace("`$.", "`").replace("$.", "")
    return ConfigError(f"{source}: {text}")


def from_dict(struct: type, data: dict[str, Any], source: str = "<dict>") -> Any:
    """Decode a plain dict into `struct`, naming `source` in any error."""
    try:
        return msgspec.convert(data, struct, strict=False)
    except msgspec.ValidationError as exc:
        raise _error_for(exc, source) from None


def to_dict(config: msgspec.Struct) -> dict[str, Any]:
    """A Struct as plain JSON-able data, with None fields left out."""
    return {k: v for k, v in msgspec.to_builtins(config).items() if v is not None}


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def load_toml(path: str | Path, struct: type, table: str | None = None) -> Any:
    """Read `struct` from a TOML file, from `[table]` when given."""
    data = read_toml(path)
    if table is not None:
        if table not in data:
            raise ConfigError(f"{path}: missing [{table}] table")
        data = data[table]
        source = f"{path} [{table}]"
    else:
        source = str(path)
    return from_dict(struct, data, source)


# Keys Hugging Face writes into config.json that describe the runtime, not the model's shape.
_HF_IGNORED_KEYS = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "hidden_act", "attention_dropout", "use_cache", "pretraining_tp", "mlp_bias",
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "initializer_range",
    "bos_token_id", "eos_token_id", "pad_token_id", "_name_or_path", "tie_word_embeddings",
    "output_attentions", "output_hidden_states", "return_dict", "rope_parameters", "head_dim",
    "is_decoder", "num_key_value_heads", "rope_scaling", "rope_theta",
}  # fmt: skip

_HF_MODEL_TYPES = {"llama", "qwen2", "mistral", "qwen3"}


def model_config_from_json(path: str | Path) -> ModelConfig:
    """Read config.json: AstrAI's own, or a Hugging Face Llama/Qwen2/Mistral one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from None
    if data.get("model_type") in _HF_MODEL_TYPES:
        data = _from_hf(data)
    return from_dict(ModelConfig, data, str(path))


def _from_hf(data: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in data.items() if k in ModelConfig.__struct_fields__}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range"):
        if data.get(k) is not None:
            out[k] = data[k]
    out["model_type"] = "decoder"
    out["num_key_value_heads"] = data.get("num_key_value_heads")
    out["head_dim"] = data.get("head_dim")
    out["tie_word_embeddings"] = data.get("tie_word_embeddings", False)
    if data["model_type"] == "qwen2":
        out["attention_bias"] = True
    if data["model_type"] == "qwen3":
        out["use_qk_norm"] = True
    # transformers >= 5 nests theta and scaling under rope_parameters
    rope = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or data.get("rope_theta") or 10000.0
    out["rope_theta"] = float(theta)
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    out["rope_scaling"] = None if kind == "default" else {"rope_type": kind, **rope}
    unknown = set(data) - set(ModelConfig.__struct_fields__) - _HF_IGNORED_KEYS
    for k in unknown:
        out.pop(k, None)
    return out


def write_model_config(path: str | Path, cfg: ModelConfig) -> None:
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


# --- training (docs/training.md lists every key) -------------------------------------------


def _require_positive(owner: object, *names: str) -> None:
    for name in names:
        if getattr(owner, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(owner, name)}")


def _require_non_negative(owner: object, *names: str) -> None:
    for name in names:
        if getattr(owner, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(owner, name)}")


class OptimizerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[optimizer]: the update rule, its hyper-parameters and gradient clipping."""

    name: Literal["adamw", "sgd", "lion"] = "adamw"
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    decay_norms: bool = False
    decay_biases: bool = False
    decay_embeddings: bool = False
    fused: bool = True  # adamw: torch's fused kernel (CPU, CUDA) instead of foreach
    max_grad_norm: float = 1.0  # 0: no clipping

    def __post_init__(self) -> None:
        _require_positive(self, "lr", "eps")
        _require_non_negative(self, "weight_decay", "momentum", "max_grad_norm")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


class ScheduleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[schedule]: the learning rate as a function of the step (peak = optimizer.lr)."""

    name: Literal["constant", "cosine", "sgdr", "wsd"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    cycle_steps: int = 0  # sgdr: length of the first cycle; 0 = the whole run
    cycle_mult: float = 1.0  # sgdr: each cycle this many times longer than the last
    decay_fraction: float = 0.2  # wsd: share of the run spent decaying
    decay_shape: Literal["linear", "cosine"] = "linear"  # wsd

    def __post_init__(self) -> None:
        _require_non_negative(self, "warmup_steps", "min_lr_ratio", "cycle_steps")
        if self.cycle_mult < 1.0:
            raise ValueError(f"cycle_mult must be >= 1, got {self.cycle_mult}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in (0, 1], got {self.decay_fraction}")


class LossConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[loss]: options of the seq/sft/dpo/grpo objectives."""

    label_smoothing: float = 0.0
    aux_loss_coef: float | None = None  # MoE balance loss; None = model's router_aux_loss_coef
    neftune_alpha: float = 0.0  # embedding noise during training (NEFTune); 0 = off
    dpo_beta: float = 0.1
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"
    dpo_label_smoothing: float = 0.0
    logp_reduction: Literal["sum", "mean"] = "sum"  # per-sequence log-prob for dpo
    grpo_clip_low: float = 0.2
    grpo_clip_high: float = 0.2
    grpo_kl_beta: float = 0.04
    grpo_averaging: Literal["token", "sequence"] = "token"
    grpo_scale_rewards: bool = True  # divide advantages by the group's std

    def __post_init__(self) -> None:
        _require_non_negative(
            self, "neftune_alpha", "grpo_clip_low", "grpo_clip_high", "grpo_kl_beta"
        )
        _require_positive(self, "dpo_beta")
        for name in ("label_smoothing", "dpo_label_smoothing"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


# Every projection of attention and the MLP: the default of [lora] targets and of init_lora.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[lora]: train low-rank adapters instead of every weight (rank 0 = full training)."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS
    seed: int = 0

    def __post_init__(self) -> None:
        _require_non_negative(self, "rank")


class TrainDataConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[data]: where batches come from."""

    source: Literal["shards", "synthetic"] = "shards"
    train: str = ""  # shards: folder written by `just prepare`
    valid: str = ""  # held-out folder; "" = no validation
    seq_len: int = 64  # synthetic: tokens per row
    shuffle: bool = True

    def __post_init__(self) -> None:
        _require_positive(self, "seq_len")


class GrpoConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[grpo]: online GRPO on a prompt dataset: rounds of rollouts through the Engine with the
    current params, scored by reward functions (the loss options stay in [loss])."""

    group_size: int = 8  # completions per prompt; advantages are normalised within a group
    prompts_per_round: int = 8  # the rollout batch: prompts per round, over all ranks
    epochs: int = 1  # passes over each round's completions
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    rewards: tuple[str, ...] = ("astrai.train.rewards.exact_match",)  # dotted paths
    reward_weights: tuple[float, ...] = ()  # one per reward; empty = 1.0 each

    def __post_init__(self) -> None:
        _require_positive(self, "prompts_per_round", "epochs", "max_new_tokens", "temperature")
        _require_non_negative(self, "top_k")
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be at least 2 (advantages compare completions of one prompt), "
                f"got {self.group_size}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.rewards:
            raise ValueError("rewards must name at least one reward function")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} entries for "
                f"{len(self.rewards)} rewards"
            )

    @property
    def rows(self) -> int:
        """Completions per round, over all ranks."""
        return self.prompts_per_round * self.group_size


class ParallelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[parallel]: how the ranks `torchrun` starts share the model (docs/training.md compares
    the modes)."""

    mode: Literal["data", "sharded"] = "data"

    @property
    def sharded(self) -> bool:
        return self.mode == "sharded"


class TrainConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A training run: the model, its data, the optimizer and how the loop runs."""

    kind: Literal["seq", "sft", "dpo", "grpo"] = "seq"
    out_dir: str = "runs/default"
    model: ModelConfig | None = None  # a fresh model of this shape ...
    init_from: str = ""  # ... or the weights of a checkpoint folder
    tokenizer: str = ""  # folder whose tokenizer files are copied into checkpoints
    seed: int = 0
    max_steps: int = 1000
    batch_size: int = 8  # sequences per optimizer step, summed over ranks and micro-batches
    grad_accum: int = 1  # micro-batches per optimizer step
    precision: Literal["float32", "bfloat16"] = "float32"
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    compile: bool = False
    activation_checkpointing: bool = False
    grad_engine: Literal["auto", "func", "autograd"] = "auto"  # see docs/training.md
    max_bad_steps: int = 10  # consecutive non-finite steps before stopping
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the end (when data.valid is set)
    eval_batches: int = 8
    checkpoint_every: int = 0  # 0 = only at the end
    keep_checkpoints: int = 3
    progress: bool = True
    bucket_mb: float = 25.0  # gradient all-reduce bucket size
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    loss: LossConfig = LossConfig()
    lora: LoraConfig = LoraConfig()
    data: TrainDataConfig = TrainDataConfig()
    grpo: GrpoConfig = GrpoConfig()
    parallel: ParallelConfig = ParallelConfig()

    def __post_init__(self) -> None:
        _require_positive(
            self, "max_steps", "batch_size", "grad_accum", "log_every", "eval_batches"
        )
        _require_positive(self, "keep_checkpoints", "max_bad_steps", "bucket_mb")
        _require_non_negative(self, "eval_every", "checkpoint_every")
        if (self.model is None) == (not self.init_from):
            raise ValueError("give exactly one of a [model] table or init_from")
        if self.grad_engine == "func" and self.activation_checkpointing:
            raise ValueError(
                "grad_engine 'func' cannot checkpoint activations (torch.func has no saved-tensor "
                "hooks); use grad_engine 'auto' or 'autograd'"
            )
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by grad_accum ({self.grad_accum})"
            )
        if self.rollouts:
            self._check_rounds()
        if self.parallel.sharded:
            self._check_sharded()

    @property
    def rollouts(self) -> bool:
        """grpo on a prompt dataset: the loop samples its own completions, round by round."""
        return self.kind == "grpo" and self.data.source == "shards" and bool(self.data.train)

    @property
    def steps_per_round(self) -> int:
        """Optimizer steps between two rollouts: `epochs` passes of batch_size rows each."""
        return self.grpo.epochs * self.grpo.rows // self.batch_size

    def _check_sharded(self) -> None:
        # Sharded params are DTensors gathered as the model reads them: eager torch.autograd only.
        unsupported = {
            "lora.rank > 0 (adapters are small: train them with mode 'data')": self.lora.rank,
            "compile = true": self.compile,
            "grad_engine 'func'": self.grad_engine == "func",
            "grpo rollouts (the Engine needs whole weights)": self.rollouts,
        }
        for what, present in unsupported.items():
            if present:
                raise ValueError(f"parallel.mode 'sharded' does not support {what}")

    def _check_rounds(self) -> None:
        if self.grpo.rows % self.batch_size:
            raise ValueError(
                f"grpo.prompts_per_round x grpo.group_size ({self.grpo.rows} completions per "
                f"round) must be a multiple of batch_size ({self.batch_size})"
            )
        # a checkpoint inside a round could not hold the rest of the round's rollouts
        if self.checkpoint_every % self.steps_per_round:
            raise ValueError(
                f"checkpoint_every ({self.checkpoint_every}) must be a multiple of the "
                f"{self.steps_per_round} optimizer steps of a grpo round"
            )


def train_config(data: dict[str, Any], source: str = "<dict>", base: Path | None = None):
    """Decode a training config; relative paths are taken from `base` (the TOML's folder).

    A [prepare] table (the data pipeline's settings, so one file can describe a whole run) is
    not part of the training config and is ignored here.
    """
    data = {k: v for k, v in data.items() if k != "prepare"}
    cfg = from_dict(TrainConfig, data, source)
    if base is None:
        return cfg

    def under(p: str) -> str:
        return p if not p or Path(p).is_absolute() else str(base / p)

    data_cfg = msgspec.structs.replace(
        cfg.data, train=under(cfg.data.train), valid=under(cfg.data.valid)
    )
    return msgspec.structs.replace(
        cfg,
        out_dir=under(cfg.out_dir),
        init_from=under(cfg.init_from),
        tokenizer=under(cfg.tokenizer),
        data=data_cfg,
    )


def load_train_config(path: str | Path) -> TrainConfig:
    """Read a training TOML (paths in it are relative to the TOML's folder)."""
    path = Path(path)
    cfg = train_config(read_toml(path), str(path), base=path.parent)
    if cfg.data.source == "shards" and not cfg.data.train:
        raise ConfigError(
            f"{path}: `data.train` must name a prepared data folder (or source = 'synthetic')"
        )
    return cfg


# --- serving (docs/serving.md lists every key) ---------------------------------------------


class ServeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[serve]: where `just serve` listens, what it allows, and how big its engine is."""

    host: str = "127.0.0.1"  # loopback only unless asked: the API has no rate limits per user
    port: int = 8000
    model_name: str | None = None  # None: the model folder's name
    api_key: str | None = None  # None: ASTRAI_API_KEY when set, else no key is asked for
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 16  # choices per request
    max_top_logprobs: int = 20
    default_max_tokens: int = 1024  # chat completions without max_tokens (cut to the context)
    max_waiting: int | None = 256  # queued requests beyond this are answered 429 / 529
    # the Engine
    num_pages: int | None = None  # None: enough for max_batch full-length sequences
    page_size: int = 16
    max_batch: int = 64
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    prefill_chunk: int = 512
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "default_max_tokens", "page_size", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("max_waiting", "num_pages", "max_seq_len"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive when given, got {getattr(self, name)}")
