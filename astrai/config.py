"""Configuration as data: frozen msgspec Structs, read from TOML or config.json.

Every Struct is validated when it is decoded: an unknown key, a wrong type or an inconsistent
value raises `ConfigError` naming the key and the file it came from.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import textwrap
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec


class ConfigError(ValueError):
    """A configuration file or value is wrong; the message names the key and the file."""


class RopeScaling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """RoPE context extension, as Hugging Face writes it in config.json."""

    rope_type: Literal["default", "linear", "dynamic", "yarn", "llama3", "longrope"] = "default"
    """`linear` divides positions by `factor`; `dynamic` grows the base with the sequence (NTK);
    `yarn` blends scaled and unscaled frequencies; `llama3` scales only low frequencies;
    `longrope` divides each frequency by a factor of its own (Phi-3)."""
    factor: float = 1.0
    """How many times longer than the original context."""
    original_max_position_embeddings: int | None = None
    """Context the model was trained with. Not set: `max_position_embeddings`."""
    # YaRN
    beta_fast: float = 32.0
    """yarn: frequencies rotating more than this many times keep their value."""
    beta_slow: float = 1.0
    """yarn: frequencies rotating fewer times are fully scaled."""
    mscale: float | None = None
    """yarn: attention temperature coefficient (DeepSeek)."""
    mscale_all_dim: float | None = None
    """yarn: its divisor (DeepSeek). Not set: the plain YaRN factor."""
    attention_factor: float | None = None
    """yarn: the attention scale itself, overriding both; longrope: the factor of cos and sin
    (not set: sqrt(1 + ln(factor) / ln(original)))."""
    # llama3
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original / this are fully scaled."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original / this are kept."""
    # longrope
    short_factor: tuple[float, ...] | None = None
    """longrope: a divisor per frequency, while every position is within the original context."""
    long_factor: tuple[float, ...] | None = None
    """longrope: the divisors once a position of the call is past it."""

    def __post_init__(self) -> None:
        if self.rope_type == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError("longrope needs short_factor and long_factor")


# The Hugging Face model types read and written (astrai/model/hf_config.py, docs/models.md).
HFFamily = Literal[
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text", "phi3",
    "smollm3", "olmo2", "granite",
]  # fmt: skip


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The shape of a model. Field names follow Hugging Face config.json."""

    vocab_size: int = 32000
    """Rows of the embedding and the output head; at least the tokenizer's vocabulary."""
    hidden_size: int = 512
    """Width of the residual stream."""
    num_hidden_layers: int = 8
    """Decoder layers."""
    num_attention_heads: int = 8
    """Query heads."""
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); must divide `num_attention_heads`. Not set: one
    per query head."""
    head_dim: int | None = None
    """Width of each head. Not set: `hidden_size / num_attention_heads`."""
    intermediate_size: int = 1408
    """Inner width of the SwiGLU MLP of dense layers."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: RopeScaling | None = None
    """RoPE context extension (`[model.rope_scaling]`). Not set: plain RoPE."""
    max_position_embeddings: int = 2048
    """Context length: the longest prompt + completion the Engine takes by default."""
    tie_word_embeddings: bool = True
    """The output head reuses the embedding matrix (no `lm_head.weight`)."""
    attention_bias: bool = False
    """Biases on the q, k and v projections (Qwen2)."""
    attention_out_bias: bool = False
    """A bias on the attention's output projection as well (Llama's `attention_bias` sets both)."""
    mlp_bias: bool = False
    """Biases on the MLP's gate, up and down projections."""
    hidden_act: Literal["silu", "gelu_pytorch_tanh"] = "silu"
    """The gated MLP's activation, and its experts': `silu` (SwiGLU) or `gelu_pytorch_tanh`
    (GeGLU with the tanh approximation of GELU, as Gemma)."""
    use_qk_norm: bool = False
    """RMSNorm over the queries and keys before RoPE (Qwen3, Gemma 3, OLMo 2)."""
    qk_norm_per_head: bool = True
    """use_qk_norm: normalise each head on its own (weights of head_dim: Qwen3, Gemma 3) or, off,
    all the heads of q and of k at once (weights of heads x head_dim: OLMo 2)."""
    use_gated_attention: bool = False
    """`q_proj` is twice as wide; its second half gates the attention output through a sigmoid."""
    norm_placement: Literal["pre", "sandwich", "post"] = "pre"
    """Where each block's RMSNorms sit. `pre` (Llama): on the input of attention and of the MLP;
    `sandwich` (Gemma 2 / 3): on their input, and on their output before the residual add;
    `post` (OLMo 2): on their output only."""
    rms_norm_unit_offset: bool = False
    """Every RMSNorm scales by 1 + weight, in float32 (Gemma): the stored weights are offsets
    from one."""
    embedding_multiplier: float = 1.0
    """The embeddings are multiplied by this, rounded to their dtype, before the first layer
    (Granite's multiplier; sqrt(hidden_size) for Gemma)."""
    residual_multiplier: float = 1.0
    """Each block's output is multiplied by this before the residual add (Granite)."""
    attention_multiplier: float | None = None
    """The attention scores are scaled by this (Granite). Not set: by query_pre_attn_scalar."""
    query_pre_attn_scalar: int | None = None
    """The attention scores are scaled by 1 / sqrt(this) (Gemma). Not set: the head width."""
    attn_logit_softcapping: float | None = None
    """Attention scores s become cap * tanh(s / cap) (Gemma 2). Not set: no cap."""
    final_logit_softcapping: float | None = None
    """The output logits are capped the same way (Gemma 2). Not set: no cap."""
    logits_scaling: float = 1.0
    """The output logits are divided by this (Granite)."""
    sliding_window: int | None = None
    """Sliding layers attend to the last `sliding_window` positions, their own included. Not
    set: every layer attends to the whole sequence."""
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] | None = None
    """Per layer, `full_attention` or `sliding_attention` (Gemma's alternation, Qwen2's
    `max_window_layers`). Not set: every layer slides when `sliding_window` is set."""
    rope_local_base_freq: float | None = None
    """RoPE base of the sliding layers, which rotate without `rope_scaling` (Gemma 3). Not set:
    every layer rotates alike."""
    partial_rotary_factor: float = 1.0
    """Share of each head's width that RoPE rotates, from its start; the rest passes as it is
    (Phi-4-mini: 0.75)."""
    nope_layers: tuple[int, ...] = ()
    """Layers that apply no RoPE at all (SmolLM3: every fourth)."""
    initializer_range: float = 0.02
    """Standard deviation of fresh weights (output projections are scaled down by depth)."""
    # multi-latent attention (DeepSeek-V2 style)
    attn_type: Literal["gqa", "mla"] = "gqa"
    """`gqa`: grouped-query attention; `mla`: DeepSeek-V2 multi-head latent attention, whose KV
    cache holds a compressed latent."""
    kv_lora_rank: int = 64
    """mla: width of the compressed key/value latent (what the cache stores)."""
    q_lora_rank: int | None = None
    """mla: width of the compressed query. Not set: queries are projected directly."""
    qk_nope_head_dim: int = 32
    """mla: per-head query/key width without RoPE."""
    qk_rope_head_dim: int = 16
    """mla: per-head query/key width with RoPE (one key shared by all heads); even."""
    v_head_dim: int = 32
    """mla: per-head value width."""
    # mixture of experts (DeepSeek style)
    ffn_type: Literal["mlp", "moe"] = "mlp"
    """`mlp`: a dense SwiGLU in every layer; `moe`: DeepSeek-style mixture of experts in the layers
    picked by `first_k_dense_replace` and `decoder_sparse_step`."""
    n_routed_experts: int = 8
    """moe: routed experts per MoE layer."""
    n_shared_experts: int = 1
    """moe: experts every token goes through (one SwiGLU of `n_shared_experts *
    moe_intermediate_size`); 0 = none."""
    num_experts_per_tok: int = 2
    """moe: routed experts per token (top-k)."""
    moe_intermediate_size: int = 256
    """moe: inner width of each expert."""
    norm_topk_prob: bool = True
    """moe: rescale the chosen experts' router weights to sum to 1."""
    decoder_sparse_step: int = 1
    """moe: layer i is MoE when `i % decoder_sparse_step == 0`."""
    first_k_dense_replace: int = 0
    """moe: the first k layers stay dense."""
    mlp_only_layers: tuple[int, ...] = ()
    """moe: these layers stay dense too (Qwen3-MoE)."""
    router_aux_loss_coef: float = 0.01
    """moe: weight of the load-balancing loss in training (`loss.aux_loss_coef` overrides it)."""
    # "decoder" is causal; "encoder" attends both ways and is used through `encode`
    model_type: Literal["decoder", "encoder"] = "decoder"
    """`decoder`: a causal language model; `encoder`: attends both ways, for embeddings through
    `encode`."""
    bos_token_id: int | None = None
    """Kept in config.json for other tools; the tokenizer decides."""
    eos_token_id: int | list[int] | None = None
    """Kept in config.json for other tools; generation stops on the tokenizer's stop ids."""
    pad_token_id: int | None = None
    """Kept in config.json for other tools."""
    family: HFFamily | None = None
    """The Hugging Face `model_type` the model was read from: `save_pretrained` writes that
    family's config.json and tensor names again, so transformers reads the folder (see
    docs/models.md). Not set: AstrAI's own config.json."""

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
        self._check_layers()
        self._check_rope()
        self._check_attention()

    def _check_layers(self) -> None:
        L = self.num_hidden_layers
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"sliding_window must be positive when given, got {self.sliding_window}"
            )
        if self.sliding_window is not None and self.model_type == "encoder":
            raise ValueError("sliding_window is for causal decoders (model_type 'decoder')")
        if self.layer_types is not None and len(self.layer_types) != L:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for num_hidden_layers = {L}"
            )
        if "sliding_attention" in (self.layer_types or ()) and self.sliding_window is None:
            raise ValueError("layer_types names sliding_attention layers: set sliding_window")
        for name in ("nope_layers", "mlp_only_layers"):
            if any(not 0 <= i < L for i in getattr(self, name)):
                raise ValueError(f"{name} must be layer indices, got {getattr(self, name)}")

    def _check_rope(self) -> None:
        if self.attn_type == "mla" and (self.partial_rotary_factor != 1 or self.nope_layers):
            raise ValueError(
                "partial_rotary_factor and nope_layers are for grouped-query attention (attn_type "
                "gqa)"
            )
        rotated = self.rotary_dim if self.attn_type == "gqa" else self.qk_rope_head_dim
        if not 0 < self.partial_rotary_factor <= 1 or rotated % 2 or not rotated:
            raise ValueError(
                f"partial_rotary_factor must leave an even, non-zero rotated width of each head, "
                f"got {self.partial_rotary_factor} of head_dim {self.dim_per_head}"
            )
        rs, half = self.rope_scaling, rotated // 2
        longrope = rs is not None and rs.rope_type == "longrope"
        if longrope and not len(rs.short_factor) == len(rs.long_factor) == half:
            raise ValueError(f"rope_scaling: longrope needs {half} short and {half} long factors")

    def _check_attention(self) -> None:
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive when given, got {getattr(self, name)}")
        if self.attention_multiplier is not None and self.query_pre_attn_scalar is not None:
            raise ValueError("give attention_multiplier or query_pre_attn_scalar, not both")
        if self.logits_scaling == 0:
            raise ValueError("logits_scaling must not be 0")
        if not self.qk_norm_per_head and self.use_gated_attention:
            raise ValueError(
                "qk_norm_per_head = false normalises plain queries: no gated attention"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Width of each head that RoPE rotates (grouped-query attention)."""
        return int(self.dim_per_head * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float | None:
        """The factor of the attention scores; None: the usual 1 / sqrt(head width)."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar**-0.5

    def beyond_llama(self) -> list[str]:
        """The settings in use that a Llama / Qwen3 layer lacks, as `key=value` (for exporters
        that speak only that layout)."""
        plain = ModelConfig(vocab_size=self.vocab_size)
        fields = (
            "hidden_act", "attention_out_bias", "mlp_bias", "norm_placement", "qk_norm_per_head",
            "rms_norm_unit_offset", "embedding_multiplier", "residual_multiplier",
            "attention_multiplier", "query_pre_attn_scalar", "attn_logit_softcapping",
            "final_logit_softcapping", "logits_scaling", "rope_local_base_freq",
            "partial_rotary_factor", "nope_layers",
        )  # fmt: skip
        extras = [
            f"{k}={getattr(self, k)!r}" for k in fields if getattr(self, k) != getattr(plain, k)
        ]
        if self.has_sliding_layers:
            extras.append(f"sliding-window attention (sliding_window={self.sliding_window})")
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "longrope":
            extras.append("rope_scaling.rope_type='longrope'")
        return extras

    def is_sliding_layer(self, i: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[i] == "sliding_attention"

    @property
    def has_sliding_layers(self) -> bool:
        if self.sliding_window is None:
            return False
        return any(self.is_sliding_layer(i) for i in range(self.num_hidden_layers))

    @property
    def attention_window(self) -> int | None:
        """How many positions back any query of any layer looks: `sliding_window` when every
        layer slides, None when some layer attends to the whole sequence. K/V further back than
        this is never read again, so an engine may give its pages back."""
        if self.sliding_window is None:
            return None
        if all(self.is_sliding_layer(i) for i in range(self.num_hidden_layers)):
            return self.sliding_window
        return None

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.ffn_type == "moe"
            and i >= self.first_k_dense_replace
            and i % self.decoder_sparse_step == 0
            and i not in self.mlp_only_layers
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


def _check_speculative(owner: object) -> None:
    """The speculative settings agree: a draft model with "draft" and only then."""
    speculative, draft_model = owner.speculative, owner.draft_model
    if speculative not in (None, "lookup", "draft"):
        raise ValueError(f'speculative must be "lookup", "draft" or not set, got {speculative!r}')
    if speculative == "draft" and not draft_model:
        raise ValueError('speculative = "draft" needs draft_model (the draft model\'s folder)')
    if draft_model and speculative != "draft":
        raise ValueError(
            f'draft_model is only used with speculative = "draft", got {speculative!r}'
        )


class OptimizerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[optimizer]: the update rule, its hyper-parameters and gradient clipping."""

    name: Literal["adamw", "sgd", "lion", "muon"] = "adamw"
    """`adamw`, `sgd` (with momentum), `lion`, or `muon` (Muon on the hidden matrices, AdamW on
    the embeddings, head, norms and biases, one learning rate for both)."""
    lr: float = 3e-4
    """Peak learning rate (the schedule scales it)."""
    beta1: float = 0.9
    """adamw, lion, muon (its AdamW part): first-moment decay."""
    beta2: float = 0.95
    """adamw, lion, muon (its AdamW part): second-moment decay (lion: of the momentum it
    keeps)."""
    eps: float = 1e-8
    """adamw: added to the denominator."""
    weight_decay: float = 0.1
    """Decoupled weight decay, on matrices only unless the `decay_*` keys say."""
    momentum: float = 0.9
    """sgd: momentum."""
    nesterov: bool = False
    """sgd: Nesterov momentum."""
    muon_momentum: float = 0.95
    """muon: the hidden matrices' momentum (Nesterov)."""
    decay_norms: bool = False
    """Also decay norm gains."""
    decay_biases: bool = False
    """Also decay biases."""
    decay_embeddings: bool = False
    """Also decay the embedding matrix."""
    fused: bool = True
    """adamw, muon (its AdamW part): torch's fused kernel instead of the foreach one."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 = no clipping."""

    def __post_init__(self) -> None:
        _require_positive(self, "lr", "eps")
        _require_non_negative(self, "weight_decay", "momentum", "max_grad_norm")
        for name in ("beta1", "beta2", "muon_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


class ScheduleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[schedule]: the learning rate as a function of the step (peak = optimizer.lr)."""

    name: Literal["constant", "cosine", "sgdr", "wsd"] = "cosine"
    """`constant`; `cosine` down to the floor at the last step; `sgdr` (cosine with warm restarts);
    `wsd` (warmup, stable, decay)."""
    warmup_steps: int = 0
    """Linear warmup from `lr / warmup_steps` to `lr`."""
    min_lr_ratio: float = 0.1
    """The floor, as a fraction of `lr`."""
    cycle_steps: int = 0
    """sgdr: length of the first cycle; 0 = the whole run."""
    cycle_mult: float = 1.0
    """sgdr: each cycle this many times longer than the last."""
    decay_fraction: float = 0.2
    """wsd: share of the run spent decaying."""
    decay_shape: Literal["linear", "cosine"] = "linear"  # wsd
    """wsd: shape of the decay."""

    def __post_init__(self) -> None:
        _require_non_negative(self, "warmup_steps", "min_lr_ratio", "cycle_steps")
        if self.cycle_mult < 1.0:
            raise ValueError(f"cycle_mult must be >= 1, got {self.cycle_mult}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in (0, 1], got {self.decay_fraction}")


class LossConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[loss]: options of the seq/sft/dpo/grpo objectives."""

    label_smoothing: float = 0.0
    """seq, sft: label smoothing of the cross entropy."""
    aux_loss_coef: float | None = None
    """MoE load-balancing loss weight. Not set: the model's `router_aux_loss_coef`."""
    neftune_alpha: float = 0.0
    """Noise added to the embeddings in training (NEFTune); 0 = off."""
    dpo_beta: float = 0.1
    """dpo: strength of the pull towards the reference model."""
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """dpo: `sigmoid` (the DPO paper) or `ipo`."""
    dpo_label_smoothing: float = 0.0
    """dpo: assumed share of flipped preference labels (cDPO)."""
    logp_reduction: Literal["sum", "mean"] = "sum"  # per-sequence log-prob for dpo
    """dpo: a sequence's log-prob as the sum or the mean over its tokens."""
    grpo_clip_low: float = 0.2
    """grpo: the ratio is clipped below at 1 - this."""
    grpo_clip_high: float = 0.2
    """grpo: the ratio is clipped above at 1 + this."""
    grpo_kl_beta: float = 0.04
    """grpo: weight of the KL penalty towards the reference model; 0 = none (and no reference
    forward pass)."""
    grpo_averaging: Literal["token", "sequence"] = "token"
    """grpo: average the loss over all tokens of the batch, or per sequence first."""
    grpo_scale_rewards: bool = True
    """grpo: divide advantages by the group's standard deviation."""

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
    """Rank of the adapters; 0 = train every weight."""
    alpha: float = 16.0
    """Adapters are scaled by `alpha / rank`."""
    targets: tuple[str, ...] = LORA_TARGETS
    """Module names whose weights get adapters."""
    seed: int = 0
    """Seeds the adapters' initial A matrices."""

    def __post_init__(self) -> None:
        _require_non_negative(self, "rank")


class TrainDataConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[data]: where batches come from."""

    source: Literal["shards", "synthetic"] = "shards"
    """`shards`: a prepared data folder; `synthetic`: generated counting sequences, to try a setup
    without data."""
    train: str = ""  # shards: folder written by `just prepare`
    """shards: the folder `just prepare` wrote."""
    valid: str = ""  # held-out folder; "" = no validation
    """A held-out prepared folder; empty = no evaluation."""
    seq_len: int = 64
    """synthetic: tokens per row."""
    shuffle: bool = True
    """Shuffle the training data each epoch."""

    def __post_init__(self) -> None:
        _require_positive(self, "seq_len")


class DistillConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[distill]: train the model towards a teacher's next-token distributions (knowledge
    distillation), e.g. a small draft model for speculative decoding from the model it drafts
    for. The teacher runs forward without gradients on every batch; it must share the
    student's tokenizer (the same vocabulary)."""

    teacher: str = ""
    """The teacher's model folder (ours or Hugging Face); empty = no distillation."""
    ce_weight: float = 0.0
    """Share of the ordinary cross entropy on the labels in the loss:
    (1 - ce_weight) x KL(teacher || student) + ce_weight x cross entropy."""
    temperature: float = 1.0
    """Both distributions are softened by this before the KL, which is scaled by its square
    (Hinton et al.) so that its gradients keep their size."""

    def __post_init__(self) -> None:
        _require_positive(self, "temperature")
        if not 0.0 <= self.ce_weight <= 1.0:
            raise ValueError(f"distill.ce_weight must be in [0, 1], got {self.ce_weight}")


class GrpoConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[grpo]: online GRPO on a prompt dataset: rounds of rollouts through the inference core
    with the current params, scored by reward functions (the loss options stay in [loss])."""

    group_size: int = 8
    """Completions sampled per prompt; advantages compare the completions of one prompt, so at
    least 2."""
    prompts_per_round: int = 8
    """Prompts per round (the rollout batch), over all ranks. A round is `epochs x
    prompts_per_round x group_size / batch_size` optimizer steps."""
    epochs: int = 1
    """Passes over each round's completions before the next rollout."""
    max_new_tokens: int = 64
    """Most tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0). The loss's log-probs are those of the untempered
    model, as are the sampler's."""
    top_p: float = 1.0
    """Nucleus sampling of the rollouts; 1 = off."""
    top_k: int = 0
    """Sample the rollouts from the k most likely tokens; 0 = off."""
    rewards: tuple[str, ...] = ("astrai.train.rewards.exact_match",)  # dotted paths
    """Reward functions by dotted path, `(prompts, completions, **record_fields) ->
    list[float]`."""
    reward_weights: tuple[float, ...] = ()
    """Weight of each reward in the total; empty = 1 each."""
    speculative: Literal["lookup", "draft"] | None = None
    """Speculative decoding of the rollouts (the engine's `speculative`): the samples keep the
    policy's distribution, and the steps that keep several tokens make rollouts faster."""
    draft_model: str | None = None
    """With speculative = "draft": the draft model's folder (the policy's tokenizer)."""
    speculative_k: int = 4
    """Most tokens proposed per completion per step."""

    def __post_init__(self) -> None:
        _require_positive(
            self, "prompts_per_round", "epochs", "max_new_tokens", "temperature", "speculative_k"
        )
        _check_speculative(self)
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


# --- evaluation (docs/evaluation.md describes the tasks) -----------------------------------

SCORERS = ("exact", "regex", "numeric")


class EvalTask(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[[eval.tasks]]: one task. `kind` says which keys it reads."""

    name: str
    """What the results table and metrics.jsonl call the task (`eval/NAME/...`)."""
    kind: Literal["perplexity", "generation", "choice"]
    """`perplexity`: loss, perplexity and bits per byte of text; `generation`: complete prompts
    and score the completions against references; `choice`: pick among options by their
    log-likelihood."""
    data: str
    """A JSONL file; for `perplexity` also a folder prepared by `just prepare`."""
    limit: int = 0
    """Evaluate only the first this many records; 0 = all of them."""
    text_key: str = "text"
    """perplexity: the JSONL key holding each document's text."""
    prompt_key: str = "prompt"
    """generation, choice: the key of the prompt (a string); a record with `messages` (a list of
    chat turns) is a chat prompt instead."""
    answer_key: str = "answer"
    """generation: the key of the reference answer; choice: of the index of the right option."""
    choices_key: str = "choices"
    """choice: the key of the list of options (strings), each scored as a continuation of the
    prompt."""
    chat: bool = True
    """generation: wrap a plain `prompt` in the model's chat template as one user turn."""
    score: str = "exact"
    """generation: `exact` (the stripped completion equals the reference), `regex` (the first
    group of `pattern` found in the completion equals the reference), `numeric` (the number
    found, by `pattern` or else the completion's final answer, equals the reference's value),
    or a dotted path to a reward function `(prompts, completions, **record_fields) ->
    list[float]` as GRPO takes (a positive score counts as correct)."""
    pattern: str = ""
    """generation: the regular expression of `regex` (and optionally `numeric`)."""
    samples: int = 1
    """generation: completions sampled per prompt; with more than one, pass@k is reported for k
    = 1 and k = samples (the unbiased estimator)."""
    max_tokens: int = 64
    """generation: most tokens per completion."""
    temperature: float = 0.0
    """generation: sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """generation: nucleus sampling; 1 = off."""
    top_k: int = 0
    """generation: sample from the k most likely tokens; 0 = off."""
    seed: int = 0
    """generation: seed of the first completion; completion i of a prompt uses seed + i."""
    stop: tuple[str, ...] = ()
    """generation: strings that end a completion (not included in it)."""

    def __post_init__(self) -> None:
        for name in ("limit", "top_k", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("samples", "max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.score not in SCORERS and "." not in self.score:
            raise ValueError(
                f"score must be one of {', '.join(SCORERS)} or a dotted path, got {self.score!r}"
            )
        if self.score == "regex" and not self.pattern:
            raise ValueError("score 'regex' needs a pattern")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError("samples > 1 needs temperature > 0 (greedy samples are all alike)")


class EvalConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[eval]: the tasks `just eval` runs, and that training runs every `eval_every` steps."""

    tasks: tuple[EvalTask, ...] = ()
    """The `[[eval.tasks]]` list."""
    model: str = ""
    """`just eval`: the model folder to evaluate (`--model` overrides it)."""
    out: str = ""
    """`just eval`: the JSON file of results. Empty: `eval.json` in the model folder."""
    batch_size: int = 16
    """Sequences per forward pass (perplexity, choice) and prompts per Engine batch."""
    device: str = "cpu"
    """`just eval`: where the model runs: cpu, cuda, cuda:1, ..."""

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must differ, got {names}")


class ParallelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """[parallel]: how the ranks `torchrun` starts share the model (docs/training.md compares
    the modes)."""

    mode: Literal["data", "sharded"] = "data"
    """`data`: every rank holds the whole model and gradients are all-reduced; `sharded`:
    each rank keeps 1/N of parameters, gradients and optimizer state (ZeRO-3 / FSDP)."""
    replicas: int = 1
    """With `sharded`: split the ranks into this many groups of consecutive ranks (e.g. one per
    machine), each holding a whole copy of the state sharded over its own ranks (hybrid
    sharding, HSDP). It must divide the number of ranks."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"parallel.replicas must be at least 1, got {self.replicas}")
        if self.replicas > 1 and self.mode != "sharded":
            raise ValueError("parallel.replicas applies to mode 'sharded' only")

    @property
    def sharded(self) -> bool:
        return self.mode == "sharded"


class TrainConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A training run: the model, its data, the optimizer and how the loop runs."""

    kind: Literal["seq", "sft", "dpo", "grpo"] = "seq"
    """The objective, and the data it reads: pretraining sequences, supervised fine-tuning,
    preference pairs (DPO) or RL prompts (GRPO)."""
    out_dir: str = "runs/default"
    """Folder of the run: checkpoints, `metrics.jsonl` and the final `model/`."""
    model: ModelConfig | None = None
    """A fresh model of this shape (the `[model]` table). Give it or `init_from`, not both."""
    init_from: str = ""  # ... or the weights of a checkpoint folder
    """Start from the weights of this model folder (ours or Hugging Face) instead of a fresh
    `[model]`."""
    tokenizer: str = ""  # folder whose tokenizer files are copied into checkpoints
    """Folder whose tokenizer files are copied into every exported model."""
    seed: int = 0
    """Seeds the fresh weights, the data order and the training noise (NEFTune)."""
    max_steps: int = 1000
    """Optimizer steps of the whole run; schedules end here."""
    batch_size: int = 8
    """Sequences per optimizer step, summed over ranks and micro-batches."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; must divide `batch_size`."""
    precision: Literal["float32", "bfloat16"] = "float32"
    """`bfloat16` runs the forward pass under autocast; weights and optimizer moments stay
    float32."""
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    """`"auto"` (CUDA when available, else CPU), `"cpu"`, `"cuda"`, `"cuda:1"`, ..."""
    compile: bool | Literal["auto"] = "auto"
    """Run the gradient computation through `torch.compile`: `"auto"` does when a C++ compiler
    (GPUs: Triton) is present and the run is long enough to repay compiling (docs/training.md)."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass: less memory, more compute."""
    grad_engine: Literal["auto", "func", "autograd"] = "auto"  # see docs/training.md
    """How gradients are taken: torch.autograd (the compiled layers run under it, and in eager
    mode it is the faster), or the one named (torch.func's "func" never compiles)."""
    max_bad_steps: int = 10
    """Consecutive steps with a non-finite loss or gradient (each skipped) before training
    stops."""
    log_every: int = 10
    """Steps between progress lines and `metrics.jsonl` records."""
    eval_every: int = 0
    """Steps between evaluations (the loss on `data.valid` and the `[eval]` tasks); 0 = only at
    the end."""
    eval_batches: int = 8
    """Batches per evaluation."""
    checkpoint_every: int = 0
    """Steps between train-state checkpoints; 0 = only at the end."""
    keep_checkpoints: int = 3
    """Checkpoints kept; older ones are deleted."""
    progress: bool = True
    """Draw the progress line on stderr."""
    bucket_mb: float = 25.0
    """Size of the gradient buckets all-reduced together under data parallelism."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; `auto` = NCCL on CUDA, else Gloo."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The `[optimizer]` table."""
    schedule: ScheduleConfig = ScheduleConfig()
    """The `[schedule]` table."""
    loss: LossConfig = LossConfig()
    """The `[loss]` table."""
    lora: LoraConfig = LoraConfig()
    """The `[lora]` table."""
    data: TrainDataConfig = TrainDataConfig()
    """The `[data]` table."""
    grpo: GrpoConfig = GrpoConfig()
    """The `[grpo]` table: online rollouts for `kind = "grpo"` on a prompt dataset."""
    eval: EvalConfig = EvalConfig()
    """The `[eval]` table: tasks evaluated with the held-out loss every `eval_every` steps (their
    results go to `metrics.jsonl` as `eval/TASK/METRIC`); `model`, `out` and `device` are
    `just eval`'s and unused here."""
    parallel: ParallelConfig = ParallelConfig()
    """The `[parallel]` table: how the ranks `torchrun` starts share the model."""
    distill: DistillConfig = DistillConfig()
    """The `[distill]` table: learn from a teacher model's distributions (kind seq or sft)."""

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
        if self.distill.teacher and self.kind not in ("seq", "sft"):
            raise ValueError(f"distill.teacher: kind must be 'seq' or 'sft', got {self.kind!r}")
        if self.optimizer.name == "muon" and self.lora.rank:
            raise ValueError(
                "optimizer 'muon' does not train LoRA adapters (their low-rank factors learned "
                "slower than with AdamW); use optimizer.name 'adamw' with lora.rank > 0"
            )

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
            "compile = true": self.compile is True,
            "grad_engine 'func'": self.grad_engine == "func",
            "grpo rollouts (sampling needs whole weights)": self.rollouts,
            "optimizer 'muon' (it orthogonalizes whole matrices)": self.optimizer.name == "muon",
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
        eval=rebase_eval(cfg.eval, base),
        out_dir=under(cfg.out_dir),
        init_from=under(cfg.init_from),
        tokenizer=under(cfg.tokenizer),
        data=data_cfg,
        distill=msgspec.structs.replace(cfg.distill, teacher=under(cfg.distill.teacher)),
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


def eval_config(data: dict[str, Any], source: str = "<dict>", base: Path | None = None):
    """Decode an [eval] table; relative paths are taken from `base` (the TOML's folder)."""
    cfg = from_dict(EvalConfig, data, source)
    return cfg if base is None else rebase_eval(cfg, base)


def rebase_eval(cfg: EvalConfig, base: Path) -> EvalConfig:
    """The [eval] table with its relative paths taken from `base`."""

    def under(p: str) -> str:
        return p if not p or Path(p).is_absolute() else str(base / p)

    tasks = tuple(msgspec.structs.replace(t, data=under(t.data)) for t in cfg.tasks)
    return msgspec.structs.replace(cfg, tasks=tasks, model=under(cfg.model), out=under(cfg.out))


def load_eval_config(path: str | Path) -> EvalConfig:
    """The [eval] table of a TOML file (a training TOML may hold it beside the run's keys)."""
    path = Path(path)
    data = read_toml(path)
    if "eval" not in data:
        raise ConfigError(f"{path}: missing [eval] table")
    return eval_config(data["eval"], f"{path} [eval]", base=path.parent)


# --- inference and serving (docs/configuration.md lists every key) -------------------------
#
# Fields are documented by the string that follows them (an attribute docstring, which
# `field_docs` reads): docs/configuration.md and the flags of `just serve` take their text
# from there, so a setting is described in one place.


def field_docs(struct: type) -> dict[str, str]:
    """{field: its attribute docstring} for a Struct and its bases, read from their source."""
    docs: dict[str, str] = {}
    for klass in reversed(struct.__mro__):
        if klass is msgspec.Struct or not issubclass(klass, msgspec.Struct):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for field, after in itertools.pairwise(body):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[field.target.id] = " ".join(after.value.value.split())
    return docs


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The engine's size and batching: the settings of `Engine` and `init_engine`."""

    num_pages: int | None = None
    """KV pages in the pool. Not set: room for `max_batch` full-length sequences, capped at
    `max_pool_bytes` of K/V (but never less than one full-length sequence)."""
    page_size: int = 16
    """Tokens per KV page; also the unit the prefix cache shares."""
    max_batch: int = 64
    """Sequences decoded together in one step (for `just serve`, also the most inputs of one
    embeddings request)."""
    max_seq_len: int | None = None
    """Prompt + completion limit. Not set: the model's `max_position_embeddings`."""
    prefill_chunk: int = 512
    """Prompt tokens prefilled per step (padded batch included), so long prompts advance a chunk
    at a time while running streams keep decoding."""
    prefill_chunk_decoding: int | None = None
    """The same budget for a step in which other requests decode. A prompt token costs compute
    that a decode step, bound by reading the weights, does not: a smaller budget keeps the
    inter-token latency of running streams steady, a larger one gives new requests their first
    token sooner. Not set: `prefill_chunk`."""
    chunked_prefill: bool = True
    """Mix prompt chunks and decode tokens in one step. Off: a step with prompts to prefill
    feeds each of them whole and decodes nothing (running streams pause while a long prompt is
    computed); for measuring what chunking is worth."""
    max_waiting: int = 0
    """Requests that may wait for a place in the batch; one more is refused (`Overloaded`,
    HTTP 429 / 529). 0: no limit."""
    prefix_cache: bool = True
    """Share the K/V of equal prompt prefixes between requests (the radix prefix cache)."""
    max_adapters: int = 8
    """LoRA adapters loaded at once (`Engine.load_adapter`): the slots of the adapter stack,
    allocated at the first load. A batch that mixes adapters multiplies its rows by every slot
    and masks what each row does not use, so its cost grows with this number, not with the
    adapters the batch uses."""
    max_adapter_rank: int | None = None
    """The highest rank an adapter may have; lower ranks are padded with zeros. Not set: the
    rank of the first adapter loaded (while none is loaded the stack is dropped, and the next
    load sets it again)."""
    adapter_targets: tuple[str, ...] | None = None
    """The modules adapters may adapt (e.g. ["q_proj", "v_proj"]); the stack holds room for
    each of them in every slot. Not set: the modules of the first adapter loaded."""
    device: str = "cpu"
    """Where the weights and the page pool live: cpu, cuda, cuda:1, mps, ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    """Weights and K/V dtype. "auto": bfloat16 where the hardware multiplies it natively
    (CUDA, AVX-512 BF16, AMX, Arm BF16), float32 otherwise; the choice is logged at start. Not
    set: the weights' own dtype (float32 for a checkpoint `just serve` loads)."""
    quantize: Literal["int8", "int4"] | None = None
    """Store the matrices of the layers and the head in 8 bits, one scale per output channel,
    or in 4 bits, a scale and a zero point per group of 32, 64 or 128 inputs (the embedding and
    the norms keep `dtype`). Which product runs (for int8 weight-only, or with activations
    quantized on the fly; for int4 the group size too) is measured per shape at load and
    logged. Not set: the weights stay in `dtype`."""
    decode_run: int = 4
    """Decode steps run back to back when a step only decodes and every request in it samples
    from its logits alone (no repetition, frequency or presence penalty, no log-probs, no
    grammar): each request gets up to
    this many tokens from one engine step, and the scheduling, the stop checks and the
    hand-over of events happen once per run instead of once per token. A request that ends
    inside a run wastes the rest of its row's steps. A run is also kept within
    `decode_run_ms` by the measured time of a step. 1: one token per step."""
    decode_run_ms: float = 20.0
    """The time a decode run may take, by the caller's measure of one step's time (the Engine
    measures its last step; rounded to the nearest count of steps): a request or a cancel that
    arrives during a run waits about this long at most. A thread-free `engine_step` given no
    step time runs `decode_run` steps."""
    seed: int = 0
    """Where the random generators of requests given no seed come from: the n-th such request
    of an engine draws from a seed mixed from this and n, so the same settings, weights and
    requests give the same events."""
    stats_interval_ms: float = 50.0
    """How old the Engine's stats snapshot gets at most while it is busy. Counting the pages is
    not free, so the snapshot is not taken at every step; it is taken at once after new
    messages, before final events go out and when the engine falls idle."""
    max_pool_bytes: int = 1 << 30
    """The K/V pool's size when `num_pages` is not set: room for `max_batch` full-length
    sequences, capped at this many bytes (but never less than one full-length sequence)."""
    stream_interval_ms: float = 20.0
    """How often at most a request's reader is handed new tokens (`Engine.stream`, `astream`,
    every stream of `just serve`): tokens that come sooner wait, at most this long, and go out
    together; a request's first token and its end go out at once. Each hand-over wakes the
    reader's thread, which on a machine with few cores takes CPU from the compute: at 20 ms, a
    stream decoding 200 tokens a second is woken 50 times a second instead of 200. 0: every
    step."""
    speculative: Literal["lookup", "draft"] | None = None
    """Speculative decoding in every engine step: a proposer guesses up to `speculative_k`
    next tokens of each decoding request, one batched forward of the model checks them all,
    and the longest run the model agrees with is kept (greedy output is unchanged; sampled
    output keeps its distribution, by rejection sampling). "lookup": copy what followed the
    request's last n-gram earlier in its prompt or output (no model; pays off when the output
    quotes its input). "draft": a smaller model with the same tokenizer (`draft_model`).
    Not set: no speculation. docs/inference.md says when the engine speculates less."""
    draft_model: str | None = None
    """With speculative = "draft": the draft model's folder, loaded like the target's; its
    vocabulary must be the target's."""
    speculative_k: int = 4
    """Most tokens proposed per request per step."""
    lookup_ngram: int = 3
    """With speculative = "lookup": the longest n-gram matched; shorter ones are tried down
    to 2 (down to 1 when this is 1)."""

    def __post_init__(self) -> None:
        _require_positive(
            self,
            "page_size",
            "max_batch",
            "prefill_chunk",
            "decode_run",
            "max_pool_bytes",
            "max_adapters",
            "speculative_k",
            "lookup_ngram",
        )
        _check_speculative(self)
        _require_non_negative(
            self, "max_waiting", "stream_interval_ms", "decode_run_ms", "stats_interval_ms"
        )
        for name in ("num_pages", "max_seq_len", "prefill_chunk_decoding", "max_adapter_rank"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive when given, got {getattr(self, name)}")
        if self.adapter_targets is not None and not self.adapter_targets:
            raise ValueError("adapter_targets must name at least one module when given")


class ServeConfig(EngineConfig, frozen=True, forbid_unknown_fields=True):
    """[serve]: where `just serve` listens and what it allows; the engine's keys (those of
    `EngineConfig`) sit in the same table."""

    host: str = "127.0.0.1"
    """Address to listen on. Loopback only unless asked: the API has no rate limits per user."""
    port: int = 8000
    """TCP port (0: any free port)."""
    model_name: str | None = None
    """The name clients use as `model`. Not set: the model folder's name."""
    api_key: str | None = None
    """Key required on every route but `/health`. Not set: `$ASTRAI_API_KEY` when set, else no
    key is asked for."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Larger request bodies get 413 (4 MiB)."""
    max_n: int = 16
    """Most choices (`n`) per request."""
    max_top_logprobs: int = 20
    """Most `top_logprobs` per token."""
    default_max_tokens: int = 1024
    """Chat completion length when a request gives no `max_tokens` (cut to the context)."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """The HTTP server's (uvicorn's) log level."""
    max_waiting: int = 256
    """The engine's `max_waiting`, limited by default: a server answers 429 / 529 rather than
    queue without end. 0: no limit."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive(self, "max_body_bytes", "max_n", "default_max_tokens")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")


def engine_config(config: EngineConfig) -> EngineConfig:
    """The EngineConfig part of a ServeConfig (or any EngineConfig subclass)."""
    names = EngineConfig.__struct_fields__
    return EngineConfig(**{name: getattr(config, name) for name in names})
