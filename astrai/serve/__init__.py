"""Serving: the OpenAI- and Anthropic-compatible HTTP API over an Engine (see docs/serving.md)."""

from astrai.serve.app import make_app
from astrai.serve.embeddings import EncoderModel

__all__ = ["EncoderModel", "make_app"]
