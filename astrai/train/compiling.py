"""Whether a run compiles (`compile = "auto" | true | false`: its decoder layer, one graph that
runs every layer, astrai/model/shared_layer.py), and a compiled function with a fallback to
eager, its compile time reported and its work cached on disk.

"auto" compiles where it can win: a run of at least `AUTO_MIN_STEPS` steps (compiling takes
tens of seconds on a CPU, which a short run cannot earn back), fixed batch shapes (GRPO's
rollouts change length every round, and each new shape would compile again), no activation
checkpointing or sharding (neither traces into one graph), and a compiler inductor can call.
docs/training.md has the measurements behind it.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import torch

from astrai.config import TrainConfig

AUTO_MIN_STEPS = 200
_NOTED: set[str] = set()  # "compile = auto" reasons already printed: one line per process


def inductor_cache_dir() -> Path:
    """Where inductor keeps compiled graphs and kernels between runs: TORCHINDUCTOR_CACHE_DIR
    (`use_user_cache_dir` points it at the user's cache unless the user chose one)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/astrai/inductor/FAMILY, or ~/.cache/astrai/inductor/FAMILY, FAMILY the
    CPU kernels torch runs (avx512, avx2, default, ...). Kernels built while torch ran one
    family and read back while it ran another gave a non-finite loss from the first step
    (built under AVX-512, read under ATEN_CPU_CAPABILITY=avx2 on the same AMD Zen 4); a home
    folder shared by machines of both kinds would do the same, so each family has its own."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    family = torch.backends.cpu.get_cpu_capability().lower()
    return Path(root) / "astrai" / "inductor" / family


def use_user_cache_dir() -> None:
    """Keep inductor's caches (FX graphs, AOTAutograd graphs, C++ kernels) under the user's
    cache folder rather than torch's default in /tmp, which many machines empty on reboot:
    a second `just train` of the same model then reads its compiled step instead of paying
    the compile again. A TORCHINDUCTOR_CACHE_DIR the user set is left as it is; torch writes
    its /tmp default into the variable as soon as inductor is imported, so that value counts
    as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(user_cache_dir())


def compiler_missing(device: torch.device) -> str | None:
    """Why inductor cannot build kernels for `device` here, or None when it can: CPU kernels
    are C++ built by the system's compiler, GPU kernels Triton's."""
    if device.type == "cpu":
        names = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
        if not any(name and shutil.which(name) for name in names):
            return "no C++ compiler (g++, c++ or clang++) on PATH"
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return f"Triton is not installed (inductor's {device.type} kernels need it)"
    return None


def should_compile(train_cfg: TrainConfig, device: torch.device) -> bool:
    """compile = true or false as given; "auto" per the module docstring (a missing compiler
    is said once, on stderr)."""
    if train_cfg.compile != "auto":
        return bool(train_cfg.compile)
    if (
        train_cfg.max_steps < AUTO_MIN_STEPS
        or train_cfg.activation_checkpointing
        or train_cfg.parallel.sharded
        or train_cfg.rollouts
    ):
        return False
    missing = compiler_missing(device)
    if missing:
        note(f"astrai: compile = auto: {missing}; training runs in eager mode")
        return False
    return True


def cache_counts() -> dict[str, int]:
    """Inductor's and AOTAutograd's cache hits and misses so far in this process."""
    from torch._dynamo.utils import counters

    return {
        "hit": counters["inductor"]["fxgraph_cache_hit"]
        + counters["aot_autograd"]["autograd_cache_hit"],
        "miss": counters["inductor"]["fxgraph_cache_miss"]
        + counters["aot_autograd"]["autograd_cache_miss"],
    }


def cache_outcome(before: dict[str, int]) -> str:
    """What the caches did since `before`: whether the compile was read back or built."""
    now = cache_counts()
    hits, misses = now["hit"] - before["hit"], now["miss"] - before["miss"]
    if hits and not misses:
        return "read from the cache"
    if misses:
        return "built and cached" if not hits else "partly read from the cache"
    return "caches off"


def note(line: str) -> None:
    """line on stderr, once per process."""
    if line not in _NOTED:
        _NOTED.add(line)
        print(line, file=sys.stderr, flush=True)


def compiled(fast, eager, what: str = "the decoder layer"):
    """fast (a function that runs torch.compile'd code), falling back to eager, the same
    function without it, if compiling fails (with one clear message); the first call, which
    compiles (or reads the cache), is timed and reported."""
    use_user_cache_dir()
    use_eager, first = False, True

    def run(*args):
        nonlocal use_eager, first
        if not use_eager:
            started, hits_before = time.perf_counter(), cache_counts()
            try:
                with torch._dynamo.config.patch(capture_scalar_outputs=True):
                    out = fast(*args)
            except Exception as exc:  # a missing compiler or backend shows up on the first call
                use_eager = True
                print(
                    f"astrai: torch.compile failed ({type(exc).__name__}: {str(exc)[:200]}); "
                    "training continues in eager mode. Set compile = false to silence this.",
                    file=sys.stderr,
                )
            else:
                if first:
                    first = False
                    seconds = time.perf_counter() - started
                    print(
                        f"astrai: compiled {what} in {seconds:.1f} s "
                        f"({cache_outcome(hits_before)}; cache in {inductor_cache_dir()})",
                        file=sys.stderr,
                        flush=True,
                    )
                return out
        return eager(*args)

    return run
