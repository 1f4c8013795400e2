"""Settings every test folder shares."""

from hypothesis import settings

# Hypothesis's per-example deadline is a timing assertion, and timings belong in benchmarks: on
# a loaded or slower machine it fails tests whose logic is right. Examples still run in full.
settings.register_profile("astrai", deadline=None)
settings.load_profile("astrai")
