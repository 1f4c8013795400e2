# AstrAI: every recipe is one line calling a program in programs/.

default:
    @just --list

# From nothing to a trained, served chat model (add --fresh to retrain)
demo *ARGS:
    python programs/demo.py {{ARGS}}

# Prepare training data: just prepare data.toml
prepare *ARGS:
    python programs/prepare.py {{ARGS}}

# Train from a TOML file: just train config.toml [--resume]
train *ARGS:
    python programs/train.py {{ARGS}}

# Serve a model over the OpenAI and Anthropic APIs: just serve [--model DIR] [--lora NAME=PATH ...]
serve *ARGS:
    python programs/serve.py {{ARGS}}

# Complete a JSONL file of prompts: just generate --model DIR --input in.jsonl --output out.jsonl
generate *ARGS:
    python programs/generate.py {{ARGS}}

# Chat with a model in the terminal: just chat [--model DIR]
chat *ARGS:
    python programs/chat.py {{ARGS}}

# Export for llama.cpp / Ollama: just export --model DIR --format gguf --out FILE.gguf [--type q8_0]
export *ARGS:
    python programs/export.py {{ARGS}}

# Measure speed against transformers and the hardware limit: just bench [--quick]
bench *ARGS:
    python programs/bench.py {{ARGS}}

# Evaluate a model: just eval eval.toml, or just eval --model DIR --data FILE.jsonl
eval *ARGS:
    python programs/eval.py {{ARGS}}

# Serving benchmark on realistic traffic, over HTTP to `just serve`: just bench-serve [--quick]
bench-serve *ARGS:
    python programs/loadgen.py {{ARGS}}

# Draw a run's curves to a PNG: just plot RUN_DIR
plot *ARGS:
    python programs/plot.py {{ARGS}}

# Run the whole test suite
test *ARGS:
    python -m pytest {{ARGS}}

# The tests that run exported files in llama.cpp (needs: pip install -e ".[dev,peer]")
test-peer *ARGS:
    python -m pytest tests/peer tests/export {{ARGS}}

# Format and lint
lint:
    ruff format . && ruff check --fix .
