"""The serving benchmark's parts: seeded workloads, a streaming HTTP client, a `just serve`
process, the transformers static-batching reference, summaries and plots (see
programs/loadgen.py)."""
