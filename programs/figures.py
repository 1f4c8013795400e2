"""matplotlib, the one way the programs draw pictures. It is an optional extra
(`pip install -e ".[plot]"`, part of `dev`): without it a program still writes its numbers
and says how to get the picture."""

from __future__ import annotations

INSTALL = 'pip install -e ".[plot]"  (or: pip install "matplotlib>=3.8")'


class NoMatplotlib(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


def pyplot():
    """matplotlib.pyplot drawing to files only (the Agg backend: no display needed)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise NoMatplotlib(f"matplotlib is not installed, so no PNG was drawn; {INSTALL}") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
