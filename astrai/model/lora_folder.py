"""LoRA adapter folders in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`,
tensors named `base_model.model.<module>.lora_A.weight` ([r, in]) and `.lora_B.weight`
([out, r]). PEFT, vLLM, SGLang and llama.cpp's converter all read this layout, so an adapter
trained here serves elsewhere and the reverse.

`load_lora` checks a folder against a base model's config and refuses, by name, what the model
cannot run: another PEFT method, options whose arithmetic differs from plain LoRA (DoRA, biases,
per-module ranks), modules the forward does not adapt, shapes that do not fit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from astrai.config import LORA_TARGETS, LoraConfig, ModelConfig
from astrai.model.checkpoint import _atomic_write
from astrai.model.hf_keys import FUSED_IN_FILES
from astrai.model.layers import FUSED
from astrai.model.params import param_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# A `just train` run folder keeps its adapter here (beside `model/`, the merged weights).
RUN_SUBFOLDER = "adapter"

# PEFT options whose non-default values change the arithmetic: refused rather than misread.
UNSUPPORTED = {
    "use_dora": (False, None),
    "lora_bias": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "layer_replication": (None, []),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, {}, []),
    "use_qalora": (False, None),
}


class AdapterError(ValueError):
    """An adapter folder that does not fit the base model, or that this forward cannot run."""


class AdapterMismatch(AdapterError):
    """An adapter whose modules, rank or matrix shapes do not fit the base model (or the
    engine's adapter stack); the message names the module and the shapes."""


class UnknownAdapter(AdapterError):
    """A request or a call names an adapter that is not loaded."""


def adaptable_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """{weight key: (out, in)} of the matrices whose products take a LoRA update in `forward`
    (every projection of attention and the dense/shared MLPs; not the embedding, the head, the
    router or the stacked experts)."""
    return {
        key: shape
        for key, shape in param_shapes(cfg).items()
        if len(shape) == 2
        and key.startswith("model.layers.")
        and key.endswith(".weight")
        and not key.endswith(".mlp.gate.weight")
    }


def adapter_folder(path: str | Path) -> Path:
    """The folder holding adapter_config.json: `path` itself, or a run folder's `adapter/`."""
    path = Path(path)
    for folder in (path, path / RUN_SUBFOLDER):
        if (folder / CONFIG_FILE).is_file():
            return folder
    raise AdapterError(f"{path}: no {CONFIG_FILE} (nor {RUN_SUBFOLDER}/{CONFIG_FILE})")


def read_adapter_config(folder: Path) -> dict:
    """adapter_config.json, checked for what changes the arithmetic; AdapterError names it."""
    where = folder / CONFIG_FILE
    try:
        config = json.loads(where.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{where}: not JSON ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config['peft_type']!r}: only LORA adapters run")
    for name, defaults in UNSUPPORTED.items():
        if config.get(name) not in defaults:
            raise AdapterError(f"{where}: {name} = {config[name]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias = {config['bias']!r} is not supported (only 'none')")
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise AdapterError(f"{where}: {name} must be a positive number, got {value!r}")
    if not isinstance(config["r"], int):
        raise AdapterError(f"{where}: r must be an integer, got {config['r']!r}")
    return config


def _module_tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{module name: {"A": ..., "B": ...}} of adapter_model.safetensors."""
    where = folder / WEIGHTS_FILE
    if not where.is_file():
        pickled = folder / "adapter_model.bin"
        why = " (pickle files can run code: save with safetensors)" if pickled.exists() else ""
        raise AdapterError(f"{folder}: no {WEIGHTS_FILE}{why}")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(where).items():
        name = key.removeprefix(PREFIX)
        for part in ("A", "B"):
            if name.endswith(f".lora_{part}.weight"):
                modules.setdefault(name.removesuffix(f".lora_{part}.weight"), {})[part] = tensor
                break
        else:
            raise AdapterError(f"{where}: tensor {key!r} is not a LoRA A or B matrix")
    for name, pair in modules.items():
        if len(pair) != 2:
            raise AdapterError(f"{where}: {name} has lora_{''.join(pair)} but not both A and B")
    return modules


def _split_fused(modules: dict, cfg: ModelConfig) -> dict:
    """A family whose files hold q/k/v (gate/up) as one matrix adapts it as one: its B splits
    by rows into one update per part, all sharing A (B @ A splits the same way)."""
    shapes = param_shapes(cfg)
    split = dict(modules)
    for fused in FUSED_IN_FILES.get(cfg.family, ()):
        for name in [n for n in modules if n.endswith(f".{fused}")]:
            prefix = name.removesuffix(f".{fused}")
            parts = [f"{prefix}.{part}" for part in FUSED[fused]]
            widths = [shapes.get(f"{part}.weight", (0,))[0] for part in parts]
            pair = split.pop(name)
            if sum(widths) != pair["B"].shape[0]:
                raise AdapterError(f"{name}: B has {pair['B'].shape[0]} rows, not {sum(widths)}")
            for part, b in zip(parts, pair["B"].split(widths), strict=True):
                split[part] = {"A": pair["A"], "B": b}
    return split


def load_lora(
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[dict, LoraConfig]:
    """A PEFT adapter folder (or a `just train` run folder with `adapter/`) for the base model
    `cfg` -> (the LoRA tree {"scale", "weights"} that `forward(..., lora=)` takes, its
    LoraConfig). AdapterError names what does not fit: a module the forward does not adapt, a
    rank other than the config's `r`, a matrix of the wrong shape, an unsupported option.

    With use_rslora the scale is alpha / sqrt(r); the LoraConfig's alpha is then the one that
    gives the same scale as alpha / rank."""
    folder = adapter_folder(path)
    config = read_adapter_config(folder)
    rank = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    modules = _split_fused(_module_tensors(folder), cfg)
    if not modules:
        raise AdapterError(f"{folder / WEIGHTS_FILE}: holds no LoRA matrices")
    shapes = adaptable_shapes(cfg)
    weights = {}
    for name, pair in sorted(modules.items()):
        key = f"{name}.weight"
        if key not in shapes:
            raise AdapterMismatch(f"{folder}: module {name} is not adapted by this model's forward")
        out_features, in_features = shapes[key]
        want = {"A": (rank, in_features), "B": (out_features, rank)}
        for part, shape in want.items():
            if tuple(pair[part].shape) != shape:
                got = tuple(pair[part].shape)
                raise AdapterMismatch(
                    f"{folder}: {name}.lora_{part} is {got}, the base model with r={rank} "
                    f"needs {shape}"
                )
        weights[key] = {p: pair[p].to(device=device, dtype=dtype) for p in ("A", "B")}
    names = {key.rsplit(".", 2)[-2] for key in weights}
    order = {name: i for i, name in enumerate(LORA_TARGETS)}
    targets = tuple(sorted(names, key=lambda n: (order.get(n, len(order)), n)))
    lora_cfg = LoraConfig(rank=rank, alpha=scale * rank, targets=targets)
    return {"scale": torch.tensor(scale, device=device), "weights": weights}, lora_cfg


def save_lora(path: str | Path, lora: dict, cfg: ModelConfig, base_model: str = "") -> Path:
    """Write the LoRA tree as a PEFT adapter folder (every adapter of one rank, as `init_lora`
    makes them). base_model: the base model's folder or hub name, for readers that look it up.
    Each file is written to a temporary name and renamed."""
    if FUSED_IN_FILES.get(cfg.family):
        raise AdapterError(
            f"family {cfg.family}: its files fuse projections that our adapters keep apart; "
            "merge the adapter (the run's model/ folder) to share it"
        )
    ranks = {pair["A"].shape[0] for pair in lora["weights"].values()}
    if len(ranks) != 1:
        raise AdapterError(f"adapters of several ranks {sorted(ranks)}: PEFT's folder has one r")
    rank = ranks.pop()
    tensors = {}
    for key, pair in lora["weights"].items():
        name = PREFIX + key.removesuffix(".weight")
        tensors[f"{name}.lora_A.weight"] = pair["A"].detach().contiguous().cpu()
        tensors[f"{name}.lora_B.weight"] = pair["B"].detach().contiguous().cpu()
    names = {key.rsplit(".", 2)[-2] for key in lora["weights"]}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model) or None,
        "r": rank,
        "lora_alpha": float(lora["scale"]) * rank,
        "target_modules": sorted(names),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    weights_file = folder / WEIGHTS_FILE
    _atomic_write(weights_file, lambda tmp: save_file(tensors, tmp, {"format": "pt"}))
    text = json.dumps(config, indent=2) + "\n"
    _atomic_write(folder / CONFIG_FILE, lambda tmp: Path(tmp).write_text(text))
    return folder
