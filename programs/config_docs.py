"""Write docs/configuration.md from the configuration Structs, so the reference cannot drift.

    python programs/config_docs.py           # rewrite docs/configuration.md
    python programs/config_docs.py --check   # exit 1 when docs/configuration.md is out of date

Keys, types, defaults and table intros (the Structs' docstrings) come from the Structs
themselves; what each key means comes from MEANINGS below. A key without a meaning, or a
meaning without a key, is an error: a new field cannot go undocumented.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path

import msgspec

from astrai.config import (
    GrpoConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RopeScaling,
    ScheduleConfig,
    ServeConfig,
    TrainConfig,
    TrainDataConfig,
)
from astrai.data.config import DataConfig, Fields

OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

# (title, Struct, TOML table it is read from ("" = top level), what reads it)
SECTIONS = [
    (
        "Training: `just train run.toml`",
        TrainConfig,
        "",
        "`load_train_config` reads the keys at the top level of the TOML, with nested tables for "
        "the model, the optimizer and so on. Relative paths are taken from the TOML's folder. "
        "A `[prepare]` table (the data pipeline's, below) may sit in the same file and is "
        "ignored here. The `[model]` table holds the same keys as a model folder's config.json. "
        "docs/training.md describes the run itself.",
    ),
    (
        "Data: `just prepare data.toml`",
        DataConfig,
        "",
        "`load_data_config` reads the keys at the top level of the TOML, or under a `[prepare]` "
        "table (then `[fields]` is `[prepare.fields]`). Relative paths are taken from the TOML's "
        "folder. docs/data.md describes the pipeline.",
    ),
    (
        "Serving: `just serve --config serve.toml`",
        ServeConfig,
        "serve",
        "`just serve` takes the defaults, then the `[serve]` table of `--config`, then its flags "
        "(`--max-batch 8` sets `max_batch`). docs/serving.md describes the server.",
    ),
]

MEANINGS: dict[type, dict[str, str]] = {
    TrainConfig: {
        "kind": "The objective, and the data it reads: pretraining sequences, supervised "
        "fine-tuning, preference pairs (DPO) or RL prompts (GRPO).",
        "out_dir": "Folder of the run: checkpoints, `metrics.jsonl` and the final `model/`.",
        "model": "A fresh model of this shape (the `[model]` table). Give it or `init_from`, "
        "not both.",
        "init_from": "Start from the weights of this model folder (ours or Hugging Face) instead "
        "of a fresh `[model]`.",
        "tokenizer": "Folder whose tokenizer files are copied into every exported model.",
        "seed": "Seeds the fresh weights, the data order and the training noise (NEFTune).",
        "max_steps": "Optimizer steps of the whole run; schedules end here.",
        "batch_size": "Sequences per optimizer step, summed over ranks and micro-batches.",
        "grad_accum": "Micro-batches per optimizer step; must divide `batch_size`.",
        "precision": "`bfloat16` runs the forward and backward matrix products under autocast "
        "(bf16 compute); weights, gradients and optimizer moments stay float32 (master weights), "
        "in both parallel modes.",
        "device": '`"auto"` (CUDA when available, else CPU), `"cpu"`, `"cuda"`, `"cuda:1"`, ...',
        "compile": "Run the gradient computation through `torch.compile`.",
        "activation_checkpointing": "Recompute each layer's activations in the backward pass: "
        "less memory, more compute.",
        "grad_engine": "How gradients are taken: torch.func when compiling, torch.autograd in "
        "eager mode (faster there), or the one named.",
        "max_bad_steps": "Consecutive steps with a non-finite loss or gradient (each skipped) "
        "before training stops.",
        "log_every": "Steps between progress lines and `metrics.jsonl` records.",
        "eval_every": "Steps between evaluations on `data.valid`; 0 = only at the end.",
        "eval_batches": "Batches per evaluation.",
        "checkpoint_every": "Steps between train-state checkpoints; 0 = only at the end.",
        "keep_checkpoints": "Checkpoints kept; older ones are deleted.",
        "progress": "Draw the progress line on stderr.",
        "bucket_mb": "Size of the gradient buckets all-reduced together under data parallelism.",
        "backend": "torch.distributed backend; `auto` = NCCL on CUDA, else Gloo.",
        "optimizer": "The `[optimizer]` table.",
        "schedule": "The `[schedule]` table.",
        "loss": "The `[loss]` table.",
        "lora": "The `[lora]` table.",
        "data": "The `[data]` table.",
        "grpo": 'The `[grpo]` table: online rollouts for `kind = "grpo"` on a prompt dataset.',
        "parallel": "The `[parallel]` table: data parallel or sharded training under torchrun.",
    },
    ModelConfig: {
        "vocab_size": "Rows of the embedding and the output head; at least the tokenizer's "
        "vocabulary.",
        "hidden_size": "Width of the residual stream.",
        "num_hidden_layers": "Decoder layers.",
        "num_attention_heads": "Query heads.",
        "num_key_value_heads": "Key/value heads (grouped-query attention); must divide "
        "`num_attention_heads`. Not set: one per query head.",
        "head_dim": "Width of each head. Not set: `hidden_size / num_attention_heads`.",
        "intermediate_size": "Inner width of the SwiGLU MLP of dense layers.",
        "rms_norm_eps": "Epsilon of every RMSNorm.",
        "rope_theta": "RoPE base.",
        "rope_scaling": "RoPE context extension (`[model.rope_scaling]`). Not set: plain RoPE.",
        "max_position_embeddings": "Context length: the longest prompt + completion the Engine "
        "takes by default.",
        "tie_word_embeddings": "The output head reuses the embedding matrix (no `lm_head.weight`).",
        "attention_bias": "Biases on the q, k and v projections (Qwen2).",
        "use_qk_norm": "RMSNorm over each query and key head before RoPE (Qwen3).",
        "use_gated_attention": "`q_proj` is twice as wide; its second half gates the attention "
        "output through a sigmoid.",
        "initializer_range": "Standard deviation of fresh weights (output projections are "
        "scaled down by depth).",
        "attn_type": "`gqa`: grouped-query attention; `mla`: DeepSeek-V2 multi-head latent "
        "attention, whose KV cache holds a compressed latent.",
        "kv_lora_rank": "mla: width of the compressed key/value latent (what the cache stores).",
        "q_lora_rank": "mla: width of the compressed query. Not set: queries are projected "
        "directly.",
        "qk_nope_head_dim": "mla: per-head query/key width without RoPE.",
        "qk_rope_head_dim": "mla: per-head query/key width with RoPE (one key shared by all "
        "heads); even.",
        "v_head_dim": "mla: per-head value width.",
        "ffn_type": "`mlp`: a dense SwiGLU in every layer; `moe`: DeepSeek-style mixture of "
        "experts in the layers picked by `first_k_dense_replace` and `decoder_sparse_step`.",
        "n_routed_experts": "moe: routed experts per MoE layer.",
        "n_shared_experts": "moe: experts every token goes through (one SwiGLU of "
        "`n_shared_experts * moe_intermediate_size`); 0 = none.",
        "num_experts_per_tok": "moe: routed experts per token (top-k).",
        "moe_intermediate_size": "moe: inner width of each expert.",
        "norm_topk_prob": "moe: rescale the chosen experts' router weights to sum to 1.",
        "decoder_sparse_step": "moe: layer i is MoE when `i % decoder_sparse_step == 0`.",
        "first_k_dense_replace": "moe: the first k layers stay dense.",
        "router_aux_loss_coef": "moe: weight of the load-balancing loss in training "
        "(`loss.aux_loss_coef` overrides it).",
        "model_type": "`decoder`: a causal language model; `encoder`: attends both ways, for "
        "embeddings through `encode`.",
        "bos_token_id": "Kept in config.json for other tools; the tokenizer decides.",
        "eos_token_id": "Kept in config.json for other tools; generation stops on the "
        "tokenizer's stop ids.",
        "pad_token_id": "Kept in config.json for other tools.",
    },
    RopeScaling: {
        "rope_type": "`linear` divides positions by `factor`; `dynamic` grows the base with the "
        "sequence (NTK); `yarn` blends scaled and unscaled frequencies; `llama3` scales only "
        "low frequencies.",
        "factor": "How many times longer than the original context.",
        "original_max_position_embeddings": "Context the model was trained with. Not set: "
        "`max_position_embeddings`.",
        "beta_fast": "yarn: frequencies rotating more than this many times keep their value.",
        "beta_slow": "yarn: frequencies rotating fewer times are fully scaled.",
        "mscale": "yarn: attention temperature coefficient (DeepSeek).",
        "mscale_all_dim": "yarn: its divisor (DeepSeek). Not set: the plain YaRN factor.",
        "attention_factor": "yarn: the attention scale itself, overriding both.",
        "low_freq_factor": "llama3: wavelengths above original / this are fully scaled.",
        "high_freq_factor": "llama3: wavelengths below original / this are kept.",
    },
    OptimizerConfig: {
        "name": "`adamw`, `sgd` (with momentum) or `lion`.",
        "lr": "Peak learning rate (the schedule scales it).",
        "beta1": "adamw, lion: first-moment decay.",
        "beta2": "adamw, lion: second-moment decay (lion: of the momentum it keeps).",
        "eps": "adamw: added to the denominator.",
        "weight_decay": "Decoupled weight decay, on matrices only unless the `decay_*` keys say.",
        "momentum": "sgd: momentum.",
        "nesterov": "sgd: Nesterov momentum.",
        "decay_norms": "Also decay norm gains.",
        "decay_biases": "Also decay biases.",
        "decay_embeddings": "Also decay the embedding matrix.",
        "fused": "adamw: torch's fused kernel instead of the foreach one.",
        "max_grad_norm": "Clip the global gradient norm to this; 0 = no clipping.",
    },
    ScheduleConfig: {
        "name": "`constant`; `cosine` down to the floor at the last step; `sgdr` (cosine with "
        "warm restarts); `wsd` (warmup, stable, decay).",
        "warmup_steps": "Linear warmup from `lr / warmup_steps` to `lr`.",
        "min_lr_ratio": "The floor, as a fraction of `lr`.",
        "cycle_steps": "sgdr: length of the first cycle; 0 = the whole run.",
        "cycle_mult": "sgdr: each cycle this many times longer than the last.",
        "decay_fraction": "wsd: share of the run spent decaying.",
        "decay_shape": "wsd: shape of the decay.",
    },
    LossConfig: {
        "label_smoothing": "seq, sft: label smoothing of the cross entropy.",
        "aux_loss_coef": "MoE load-balancing loss weight. Not set: the model's "
        "`router_aux_loss_coef`.",
        "neftune_alpha": "Noise added to the embeddings in training (NEFTune); 0 = off.",
        "dpo_beta": "dpo: strength of the pull towards the reference model.",
        "dpo_loss": "dpo: `sigmoid` (the DPO paper) or `ipo`.",
        "dpo_label_smoothing": "dpo: assumed share of flipped preference labels (cDPO).",
        "logp_reduction": "dpo: a sequence's log-prob as the sum or the mean over its tokens.",
        "grpo_clip_low": "grpo: the ratio is clipped below at 1 - this.",
        "grpo_clip_high": "grpo: the ratio is clipped above at 1 + this.",
        "grpo_kl_beta": "grpo: weight of the KL penalty towards the reference model; 0 = none "
        "(and no reference forward pass).",
        "grpo_averaging": "grpo: average the loss over all tokens of the batch, or per "
        "sequence first.",
        "grpo_scale_rewards": "grpo: divide advantages by the group's standard deviation.",
    },
    LoraConfig: {
        "rank": "Rank of the adapters; 0 = train every weight.",
        "alpha": "Adapters are scaled by `alpha / rank`.",
        "targets": "Module names whose weights get adapters.",
        "seed": "Seeds the adapters' initial A matrices.",
    },
    TrainDataConfig: {
        "source": "`shards`: a prepared data folder; `synthetic`: generated counting "
        "sequences, to try a setup without data.",
        "train": "shards: the folder `just prepare` wrote.",
        "valid": "A held-out prepared folder; empty = no evaluation.",
        "seq_len": "synthetic: tokens per row.",
        "shuffle": "Shuffle the training data each epoch.",
    },
    ParallelConfig: {
        "mode": "`data`: every rank holds the whole model, gradients are all-reduced. "
        "`sharded` (ZeRO-3 / FSDP): each rank holds 1/N of the params, gradients and optimizer "
        "moments; each layer's weights are all-gathered for its forward and again for its "
        "backward (the layer is recomputed), and gradients are reduce-scattered. Not with "
        "LoRA, `compile` or grpo rollouts; checkpoints are sharded (torch.distributed.checkpoint).",
    },
    GrpoConfig: {
        "group_size": "Completions sampled per prompt; advantages compare the completions of "
        "one prompt, so at least 2.",
        "prompts_per_round": "Prompts per round (the rollout batch), over all ranks. A round "
        "is `epochs x prompts_per_round x group_size / batch_size` optimizer steps.",
        "epochs": "Passes over each round's completions before the next rollout.",
        "max_new_tokens": "Most tokens per completion.",
        "temperature": "Sampling temperature of the rollouts (> 0). The loss's log-probs are "
        "those of the untempered model, as are the Engine's.",
        "top_p": "Nucleus sampling of the rollouts; 1 = off.",
        "top_k": "Sample the rollouts from the k most likely tokens; 0 = off.",
        "rewards": "Reward functions by dotted path, `(prompts, completions, **record_fields) "
        "-> list[float]`.",
        "reward_weights": "Weight of each reward in the total; empty = 1 each.",
    },
    DataConfig: {
        "tokenizer": "Folder holding the tokenizer (`tokenizer.json`).",
        "inputs": "JSONL files or globs (`**` allowed), read in the order given.",
        "output": "Folder to write; required by `prepare`.",
        "kind": "What the data feeds: pretraining sequences, supervised fine-tuning, preference "
        "pairs or RL prompts.",
        "format": "How a record becomes text. Not set: seq and sft read `text` and `chat`, dpo "
        "`preference`, grpo `prompt`.",
        "template": "Render prompts and replies through the tokenizer's chat template, or as "
        "plain text.",
        "fields": "The `[fields]` table.",
        "train_on": "Sections trained on: `all`, `assistant`, `last_assistant` or a list of "
        "roles. Not set: `all` for seq, grpo and text; `assistant` for sft and dpo.",
        "add_bos": "text and plain formats: start each record with bos.",
        "add_eos": "text and plain formats: end each record with eos.",
        "max_seq_len": "Tokens per row: the `T` of every batch.",
        "min_chars": "Drop records with fewer characters.",
        "max_chars": "Drop records with more characters. Not set: no limit.",
        "max_items": "Stop after keeping this many records. Not set: all.",
        "too_long": "A record longer than `max_seq_len` is cut, dropped, or split into "
        "pieces (not for dpo and grpo).",
        "truncate_side": "`right` keeps the beginning, `left` the end.",
        "packing": "How documents become rows: one per row, next fit, or best fit decreasing "
        "(dpo and grpo need `none`).",
        "positions": "Store position ids counting along each row, or restarting at each "
        "document (which also masks attention across documents).",
        "shard_tokens": "About how many tokens one shard holds (2^25).",
        "strict": "Stop at the first bad record instead of skipping and counting it.",
        "workers": "Processes that parse and tokenise; the output is the same for any number.",
        "batch_records": "Records per tokeniser call (a worker's unit of work).",
        "progress": "Draw a progress line on stderr.",
    },
    Fields: {
        "text": "text format: the text.",
        "messages": "chat format: the list of `{role, content}` messages.",
        "prompt": "prompt_response, preference and prompt formats: a string or a message list.",
        "response": "prompt_response format: the reply.",
        "chosen": "preference format: the preferred reply.",
        "rejected": "preference format: the other reply.",
        "answer": "prompt format: the reference answer, kept for reward functions.",
        "tools": "Tool signatures rendered by the chat template, when a record has them.",
    },
    ServeConfig: {
        "host": "Address to bind; loopback unless asked, as the API has no per-user limits.",
        "port": "Port to listen on.",
        "model_name": "The name clients ask for. Not set: the model folder's name.",
        "api_key": "Key required on every route but `/health`. Not set: `$ASTRAI_API_KEY` "
        "when set, else no key.",
        "max_body_bytes": "Larger request bodies get 413 (4 MiB).",
        "max_n": "Most choices per request.",
        "max_top_logprobs": "Most `top_logprobs` per token.",
        "default_max_tokens": "Chat completion length when a request gives none (cut to the "
        "context).",
        "max_waiting": "Queued requests beyond this get 429 / 529.",
        "num_pages": "KV pages in the pool. Not set: enough for `max_batch` full-length "
        "sequences, at most 1 GiB of K/V.",
        "page_size": "Tokens per KV page.",
        "max_batch": "Sequences decoded together.",
        "max_seq_len": "Prompt + completion limit. Not set: the model's `max_position_embeddings`.",
        "prefill_chunk": "Prompt tokens prefilled per engine step.",
        "device": "`cpu`, `cuda`, `cuda:1`, `mps`, ...",
        "dtype": "Weights and KV pool dtype.",
        "log_level": "uvicorn's log level.",
    },
}


def struct_of(tp) -> type | None:
    """The Struct class inside `tp` (a Struct or `Struct | None`), else None."""
    args = typing.get_args(tp) if is_union(tp) else (tp,)
    found = [a for a in args if isinstance(a, type) and issubclass(a, msgspec.Struct)]
    return found[0] if found else None


def is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def type_text(tp) -> str:
    if is_union(tp):  # None is shown as "not set" in the default column instead
        return " or ".join(type_text(a) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in typing.get_args(tp))
    if typing.get_origin(tp) in (list, tuple):
        return "list of " + {str: "strings", int: "ints", float: "floats"}[typing.get_args(tp)[0]]
    if struct_of(tp):
        return "table"
    return {int: "int", float: "float", bool: "bool", str: "string"}[tp]


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def default_text(field) -> str:
    if field.required:
        return "(required)"
    value = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    if value is None:
        return "not set"
    if isinstance(value, msgspec.Struct):
        return "its defaults"
    return f"`{toml_value(value)}`"


def intro(struct: type) -> str:
    """The docstring's first paragraph, without the "[table]: " that the heading shows."""
    text = (struct.__doc__ or "").strip().split("\n\n")[0]
    text = " ".join(text.split())
    if text.startswith("[") and "]: " in text:
        text = text.split("]: ", 1)[1]
    return text[0].upper() + text[1:]


def meanings(struct: type) -> dict[str, str]:
    names = [f.name for f in msgspec.structs.fields(struct)]
    given = MEANINGS.get(struct, {})
    missing = [n for n in names if n not in given]
    stale = [n for n in given if n not in names]
    if missing or stale:
        raise SystemExit(
            f"programs/config_docs.py: MEANINGS[{struct.__name__}] lacks {missing} and has "
            f"keys the Struct does not: {stale}"
        )
    return given


def tables(struct: type, path: str) -> list[str]:
    """A heading and a key table for `struct`, then the same for each table nested in it."""
    heading = f"`[{path}]`" if path else "Top level"
    lines = [f"### {heading}", "", f"{intro(struct)} (`{struct.__name__}`)", ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    said = meanings(struct)
    nested = []
    for field in msgspec.structs.fields(struct):
        row = [f"`{field.name}`", type_text(field.type), default_text(field), said[field.name]]
        lines.append("| " + " | ".join(row) + " |")
        if inner := struct_of(field.type):
            nested.append((inner, f"{path}.{field.name}" if path else field.name))
    for inner, inner_path in nested:
        lines += ["", *tables(inner, inner_path)]
    return lines


def render() -> str:
    lines = [
        "<!-- Generated from the config Structs by programs/config_docs.py; do not edit by "
        "hand. Refresh: python programs/config_docs.py -->",
        "",
        "# Configuration",
        "",
        "Every setting is a field of a frozen msgspec Struct (`astrai/config.py`, "
        "`astrai/data/config.py`), read from TOML. An unknown key, a wrong type or an "
        "inconsistent value is a `ConfigError` that names the key and the file. A key left out "
        'takes its default; "not set" means the key is simply absent (TOML has no null).',
    ]
    for title, struct, table, reader in SECTIONS:
        lines += ["", f"## {title}", "", reader, "", *tables(struct, table)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is out of date: run python programs/config_docs.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
