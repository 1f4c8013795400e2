"""Fixtures of the evaluation tests (the tiny model lives in eval_fixtures.py)."""

from eval_fixtures import model_dir, short_model_dir  # noqa: F401
