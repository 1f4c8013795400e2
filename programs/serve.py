"""Serve a model over the OpenAI and Anthropic HTTP APIs.

    just serve --model DIR [--port 8000] [--api-key KEY] [--config serve.toml]
    just serve --model BASE --lora NAME=PATH [--lora NAME2=PATH2 ...]   # LoRA adapters over BASE
    just serve                  # the demo model, runs/demo/model (made by `just demo`)
    just serve --random-tiny    # an untrained tiny model, for a quick look at the API

Settings come from ServeConfig (the EngineConfig fields and the server's own): its defaults,
then the [serve] table of --config, then flags, one per field (`--max-batch 8` sets max_batch).
The API key may also come from the ASTRAI_API_KEY environment variable. Each --lora loads an
adapter folder (PEFT's, or a `just train` run's) that requests select with `model` NAME.
docs/serving.md lists every endpoint; docs/configuration.md every setting.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import sys
import tempfile
import typing
from pathlib import Path

import msgspec

DEMO_MODEL = Path("runs/demo/model")

# Enough text for a byte-level BPE to learn a few merges; the weights stay random.
TINY_TEXT = [
    "Hello! How can I help you today?",
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? 12 + 30 = 42.",
    "I am a tiny model with random weights: my answers are noise.",
] * 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help=f"model folder (default: {DEMO_MODEL} when it exists)")
    source.add_argument(
        "--random-tiny",
        action="store_true",
        help="serve a random-weight tiny model with a trained tokenizer (made in a temp folder)",
    )
    parser.add_argument("--config", help="TOML file whose [serve] table sets ServeConfig")
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the LoRA adapter folder PATH (PEFT's, or a `just train` run's) as model NAME "
        "over the base model; repeat for more adapters",
    )
    add_config_flags(parser)
    return parser.parse_args(argv)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ServeConfig field, its help the field's own documentation."""
    from astrai.config import ServeConfig, field_docs

    docs = field_docs(ServeConfig)
    for field in msgspec.structs.fields(ServeConfig):
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{docs[field.name]} (default: {field.default})"
        kind = field.type
        given = [t for t in typing.get_args(kind) if t is not type(None)]
        if len(given) == 1:  # X | None: a flag gives an X
            kind = given[0]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(kind), help=help_text)
        elif typing.get_origin(kind) in (tuple, list):  # --adapter-targets q_proj v_proj
            parser.add_argument(flag, nargs="+", metavar=field.name.upper(), help=help_text)
        else:  # int, str, or one of them or None: msgspec converts and checks the text
            parser.add_argument(flag, metavar=field.name.upper(), help=help_text)


def serve_config(args: argparse.Namespace, environ=os.environ):
    """Defaults < [serve] of --config < flags; the key falls back to ASTRAI_API_KEY."""
    from astrai.config import ServeConfig, from_dict, load_toml, to_dict

    base = load_toml(args.config, ServeConfig, "serve") if args.config else ServeConfig()
    names = ServeConfig.__struct_fields__
    flags = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    merged = {**to_dict(base), **flags}
    if merged.get("api_key") is None and environ.get("ASTRAI_API_KEY"):
        merged["api_key"] = environ["ASTRAI_API_KEY"]
    return from_dict(ServeConfig, merged, "command-line flags")


class LoraFlagError(ValueError):
    """A --lora flag that cannot be served; the message quotes it."""


def adapter_flags(values: list[str], base_name: str) -> dict[str, str]:
    """--lora NAME=PATH values -> {name: path}; LoraFlagError quoting the flag at fault."""
    from astrai.serve.adapters import adapter_name_problem

    adapters: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not path:
            raise LoraFlagError(f"--lora {value}: expected NAME=PATH, e.g. --lora sql=runs/sql")
        problem = adapter_name_problem(name, base_name)
        if problem is not None:
            raise LoraFlagError(f"--lora {value}: {problem}")
        if name in adapters:
            raise LoraFlagError(f"--lora {value}: the name `{name}` is given twice")
        adapters[name] = path
    return adapters


def read_adapters(folder: Path, adapters: dict[str, str]) -> dict[str, tuple]:
    """{name: path} -> {name: (path, lora params, LoraConfig)}, each adapter read and checked
    against the base model in `folder`; LoraFlagError quoting the flag whose folder is missing
    or does not fit (the message names the module and the shapes)."""
    from astrai.model import load_lora, model_config_from_json

    if not adapters:
        return {}
    cfg = model_config_from_json(folder / "config.json")
    if cfg.model_type == "encoder":
        raise LoraFlagError("--lora: an encoder model takes no adapters")
    read = {}
    for name, path in adapters.items():
        try:
            read[name] = (path, *load_lora(path, cfg))
        except (OSError, ValueError) as exc:  # AdapterError is a ValueError
            raise LoraFlagError(f"--lora {name}={path}: {exc}") from None
    return read


def with_adapter_room(serve_cfg, adapters: dict[str, tuple]):
    """The engine's adapter stack sized for every --lora adapter: its highest rank and all
    their modules, where the settings leave them unset (the engine would size the stack for the
    first adapter alone, and refuse a second of higher rank or other modules)."""
    if not adapters:
        return serve_cfg
    lora_cfgs = [lora_cfg for _, _, lora_cfg in adapters.values()]
    rank = serve_cfg.max_adapter_rank or max(c.rank for c in lora_cfgs)
    targets = serve_cfg.adapter_targets or tuple(
        dict.fromkeys(t for c in lora_cfgs for t in c.targets)
    )
    return msgspec.structs.replace(serve_cfg, max_adapter_rank=rank, adapter_targets=targets)


def load_adapters(engine, adapters: dict[str, tuple]) -> None:
    """Each adapter read by read_adapters into the engine; LoraFlagError quoting the flag the
    engine refuses (no free slot, a rank or module the stack has no room for)."""
    for name, (path, lora, lora_cfg) in adapters.items():
        try:
            engine.load_adapter(name, (lora, lora_cfg))
        except ValueError as exc:  # AdapterError is a ValueError
            raise LoraFlagError(f"--lora {name}={path}: {exc}") from None


def start_engine(args: argparse.Namespace, folder: Path, serve_cfg, name: str):
    """The engine `just serve` runs: the model in `folder` served as `name`, with the --lora
    adapters loaded. LoraFlagError for a flag at fault; OSError or ValueError for a model folder
    that cannot be loaded."""
    adapters = read_adapters(folder, adapter_flags(args.lora, name))
    engine = load_engine(folder, with_adapter_room(serve_cfg, adapters))
    try:
        load_adapters(engine, adapters)
    except LoraFlagError:
        engine.close()
        raise
    return engine


def make_random_tiny(path: Path) -> Path:
    """A random-weight model and a tokenizer trained on a few sentences, saved to `path`."""
    import astrai
    from astrai.config import ModelConfig
    from astrai.tokenizer import Tokenizer

    tok = Tokenizer.train(TINY_TEXT, vocab_size=512)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=2048,
        eos_token_id=tok.eos_id,
    )
    astrai.save_pretrained(path, astrai.init_params(cfg, seed=0), cfg, tokenizer=tok)
    return path


def model_folder(args: argparse.Namespace) -> Path | None:
    if args.model:
        return Path(args.model)
    if args.random_tiny:
        return make_random_tiny(Path(tempfile.mkdtemp(prefix="astrai-random-tiny-")))
    if DEMO_MODEL.is_dir():
        return DEMO_MODEL
    print(
        f"No --model given, and there is no demo model at {DEMO_MODEL}.\n"
        "Train the demo model (a few minutes on a laptop) with:\n\n"
        "    just demo\n\n"
        "or look at the API with an untrained model:\n\n"
        "    just serve --random-tiny\n",
        file=sys.stderr,
    )
    return None


def default_name(folder: Path, args: argparse.Namespace) -> str:
    if args.random_tiny:
        return "random-tiny"
    folder = folder.resolve()
    # runs/<name>/model: the run's name says more than "model"
    return folder.parent.name if folder.name == "model" else folder.name


def load_engine(folder: Path, serve_cfg):
    """The model in `folder` -> an Engine (or an EncoderModel for an encoder). An Engine reads
    its weights on its own thread: the process keeps one thread doing torch work."""
    import astrai
    from astrai.config import engine_config
    from astrai.infer import Engine
    from astrai.model import model_config_from_json
    from astrai.serve import EncoderModel
    from astrai.tokenizer import Tokenizer

    cfg = model_config_from_json(folder / "config.json")
    tokenizer = Tokenizer.from_pretrained(folder)
    if cfg.model_type == "encoder":
        if serve_cfg.speculative:
            raise ValueError("speculative decoding needs a decoder; this is an encoder model")
        dtype = serve_cfg.dtype if serve_cfg.dtype not in (None, "auto") else "float32"
        params, cfg = astrai.load_pretrained(folder, dtype=dtype, device=serve_cfg.device)
        return EncoderModel(params, cfg, tokenizer, serve_cfg.device)
    return Engine.from_pretrained(folder, engine_config(serve_cfg), tokenizer=tokenizer)


def describe_weights(engine, serve_cfg) -> str:
    """One line: the dtype the weights run in (and why, for "auto"), and each matrix product."""
    from astrai.infer.hardware import describe_dtype_choice

    config = getattr(engine, "config", serve_cfg)
    dtype = config.dtype or "float32"
    if serve_cfg.dtype == "auto":
        dtype = describe_dtype_choice(serve_cfg.device)
    kernels = getattr(engine, "kernels", {})
    products = ", ".join(f"{n} {kind}" for kind, n in kernels.items())
    return f"Weights: {dtype}" + (f"; matrix products: {products}" if products else "")


def describe_speculation(serve_cfg) -> str:
    """One line: how the server speculates, and where its counts are."""
    source = (
        f"a draft model ({serve_cfg.draft_model})"
        if serve_cfg.speculative == "draft"
        else f"prompt lookup (n-grams up to {serve_cfg.lookup_ngram})"
    )
    return (
        f"Speculative decoding: up to {serve_cfg.speculative_k} tokens per step from {source};"
        " proposed / accepted tokens in /stats and /metrics"
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        serve_cfg = serve_config(args)
    except (ValueError, msgspec.ValidationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    folder = model_folder(args)
    if folder is None:
        return 2
    try:
        return run(args, folder, serve_cfg)
    finally:
        if args.random_tiny:  # it was made for this run only
            shutil.rmtree(folder, ignore_errors=True)


def run(args: argparse.Namespace, folder: Path, serve_cfg) -> int:
    from speculation_flags import check_draft

    name = serve_cfg.model_name or default_name(folder, args)
    try:
        check_draft(serve_cfg.draft_model, folder)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        engine = start_engine(args, folder, serve_cfg, name)
    except LoraFlagError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # a missing folder, a bad config.json or checkpoint
        print(f"error: cannot load {folder}: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from astrai.serve import make_app

    app = make_app(engine, name, serve_cfg)
    if not is_loopback(serve_cfg.host) and serve_cfg.api_key is None:
        print(f"warning: listening on {serve_cfg.host} without an API key", file=sys.stderr)
    url = f"http://{serve_cfg.host}:{serve_cfg.port}"
    print(f"Serving `{name}` from {folder} at {url}/v1 (OpenAI) and {url} (Anthropic)")
    for adapter, path in adapter_flags(args.lora, name).items():
        print(f"  with LoRA adapter `{adapter}` from {path} (model `{adapter}`)")
    print(describe_weights(engine, serve_cfg))
    if serve_cfg.speculative:
        print(describe_speculation(serve_cfg))
    print(f"Chat with it in your browser: {url}/")
    try:
        uvicorn.run(
            app,
            host=serve_cfg.host,
            port=serve_cfg.port,
            log_level=serve_cfg.log_level,
            timeout_graceful_shutdown=5,  # open streams must not keep Ctrl-C waiting
        )
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
