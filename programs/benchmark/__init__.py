"""Benchmarks: our code and a reference (transformers) on the same weights and inputs, side by
side in one process, reported as ratios. `programs/bench.py` runs them; docs/benchmarks.md
explains how to read the figures."""
