# AstrAI: every recipe is one line calling a program in programs/.

default:
    @just --list

# Run the whole test suite
test *ARGS:
    python -m pytest {{ARGS}}

# Format and lint
lint:
    ruff format . && ruff check --fix .

# Serve a model over the OpenAI and Anthropic APIs
serve *ARGS:
    python programs/serve.py {{ARGS}}
