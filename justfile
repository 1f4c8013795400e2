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

# Serve a model over the OpenAI and Anthropic APIs: just serve [--model DIR]
serve *ARGS:
    python programs/serve.py {{ARGS}}

# Complete a JSONL file of prompts: just generate --model DIR --input in.jsonl --output out.jsonl
generate *ARGS:
    python programs/generate.py {{ARGS}}

# Chat with a model in the terminal: just chat [--model DIR]
chat *ARGS:
    python programs/chat.py {{ARGS}}

# Measure speed against transformers and the hardware limit: just bench [--quick]
bench *ARGS:
    python programs/bench.py {{ARGS}}

# Serving benchmark on realistic traffic, over HTTP to `just serve`: just bench-serve [--quick]
bench-serve *ARGS:
    python programs/loadgen.py {{ARGS}}

# Draw a run's curves to a PNG: just plot RUN_DIR
plot *ARGS:
    python programs/plot.py {{ARGS}}

# Run the whole test suite
test *ARGS:
    python -m pytest {{ARGS}}

# Format and lint
lint:
    ruff format . && ruff check --fix .
