"""Engine: `engine_step` on a background thread, for servers and batch jobs.

Callers on any thread send messages to the thread's inbox and read their request's events
from a queue of their own. Only the engine thread (worker.py) touches the engine state, so it
needs no locks; all torch work of the engine runs on that one thread (docs/inference.md says
why).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import uuid
from collections.abc import Callable
from os import PathLike
from typing import Any

from astrai.config import EngineConfig, LoraConfig, ModelConfig
from astrai.infer.adapters import AdapterInfo, load_adapter, unload_adapter
from astrai.infer.delivery import Sink
from astrai.infer.events import Completion, Events, wait_all, wait_one
from astrai.infer.hardware import release_thread_team
from astrai.infer.inbox import (
    Call,
    Cancel,
    ChangeState,
    Close,
    Message,
    Started,
    Submit,
    SwapParams,
    Waiting,
)
from astrai.infer.requests import Request, new_sequence
from astrai.infer.sampling import SamplingParams, with_fields
from astrai.infer.sequence import Sequence
from astrai.infer.stats import EngineStats
from astrai.infer.worker import THREAD_NAME, EngineLoop
from astrai.model import DTYPES, Params
from astrai.model.lora_folder import UnknownAdapter, load_lora

__all__ = ["THREAD_NAME", "Engine"]

Sampling = SamplingParams | None
# An adapter to load: a folder (PEFT's adapter_config.json + adapter_model.safetensors, or a
# `just train` run folder with `adapter/`), or in memory (lora params, LoraConfig).
AdapterSource = str | PathLike | tuple[dict, LoraConfig]


class Engine:
    """Continuous-batching generation over a model, on a background thread.

    engine.generate(prompts, sampling) blocks for a batch; submit/result, stream and astream
    serve one request each. Each takes a SamplingParams and/or its fields as keyword
    arguments (which win); settings are the fields of EngineConfig, as `config` and/or keyword
    arguments. `params` may be a function that returns the weights: it is called on the
    engine thread, so that loading them runs no torch work on the caller's.
    """

    def __init__(
        self,
        params: Params | Callable[[], Params],
        cfg: ModelConfig,
        tokenizer,
        config: EngineConfig | None = None,
        **settings,
    ):
        self.cfg, self.tokenizer = cfg, tokenizer
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()  # C: cheap to poll
        self._waiting = Waiting()
        self._results: dict[str, queue.SimpleQueue] = {}
        self._counter = itertools.count()
        self._closed = False
        self._loop = EngineLoop(cfg, tokenizer, self._inbox, self._waiting)
        started = Started()
        self._thread = threading.Thread(
            target=self._loop.run,
            args=(params, config, settings, started),
            name=THREAD_NAME,
            daemon=True,
        )
        self._thread.start()
        started.done.wait()
        if started.error is not None:
            self._thread.join()
            raise started.error
        self.config: EngineConfig = self._loop.config
        self.max_seq_len = self.config.max_seq_len

    @classmethod
    def from_pretrained(
        cls, path, config: EngineConfig | None = None, tokenizer=None, **settings
    ) -> Engine:
        """An Engine over the model folder `path` (written by `save_pretrained` or transformers),
        its weights read on the engine thread. The tokenizer is the folder's unless given."""
        from pathlib import Path

        from astrai.model import load_pretrained, model_config_from_json
        from astrai.tokenizer import Tokenizer

        path = Path(path)
        cfg = model_config_from_json(path / "config.json")
        if tokenizer is None:
            tokenizer = Tokenizer.from_pretrained(path)
        return cls(lambda: load_pretrained(path)[0], cfg, tokenizer, config, **settings)

    @property
    def kernels(self) -> dict[str, int]:
        """How many matrices each product runs (see prepare.kernels_used), for the logs."""
        return self._loop.kernels

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: list[str | list[int]],
        sampling: Sampling = None,
        adapter: str | list[str | None] | None = None,
        **fields,
    ) -> list[Completion]:
        """Generate for every prompt, batched (all join before the same step, so the batches,
        and the numbers, do not depend on timing); blocks until all are done. `adapter`: the
        LoRA adapter of every prompt, or a list with one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate takes a list of prompts; use submit or stream for one")
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} adapters for {len(prompts)} prompts")
        events: queue.SimpleQueue = queue.SimpleQueue()
        seqs = [self._sequence(p, sampling, fields, None, a) for p, a in zip(prompts, adapters)]
        self._send(seqs, Sink(events.put))  # one caller's work: checked against max_waiting once
        return wait_all(events, [seq.id for seq in seqs])

    def submit(
        self,
        prompt: str | list[int],
        sampling: Sampling = None,
        adapter: str | None = None,
        **fields,
    ) -> str:
        """Queue one request and return its id at once; `result(id)` waits for it. `adapter`:
        a loaded LoRA adapter's name (None: the base model); UnknownAdapter otherwise, as for
        every entry point."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        seq = self._sequence(prompt, sampling, fields, None, adapter)
        self._results[seq.id] = events
        self._send([seq], Sink(events.put))
        return seq.id

    def result(self, request_id: str, timeout: float | None = None) -> Completion:
        """The Completion of a submitted request (blocks until it finishes)."""
        events = self._results.get(request_id)
        if events is None:
            raise KeyError(f"no submitted request {request_id!r} waits for its result")
        completion = wait_one(events, request_id, timeout)
        del self._results[request_id]
        return completion

    def stream(
        self,
        prompt: str | list[int],
        sampling: Sampling = None,
        adapter: str | None = None,
        **fields,
    ) -> Events:
        """Submit now; iterate the request's events. Leaving the loop early cancels it."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        seq = self._sequence(prompt, sampling, fields, None, adapter)
        self._send([seq], Sink(events.put))
        return Events(events, lambda: self.cancel(seq.id))

    def astream(
        self,
        prompt: str | list[int],
        sampling: Sampling = None,
        request_id: str | None = None,
        adapter: str | None = None,
        **fields,
    ) -> Events:
        """stream() for an asyncio event loop: call it inside the loop. Closing the iterator or
        cancelling the task that reads it cancels the request and frees its pages.
        `request_id` names the request in its events (a server passes its own, so that one id
        follows a request through both); it must differ from every other live request's."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        seq = self._sequence(prompt, sampling, fields, request_id, adapter)
        self._send([seq], Sink(events.put_nowait, loop))
        return Events(events, lambda: self.cancel(seq.id))

    def cancel(self, request_id: str) -> None:
        """Stop a request; it finishes with finish_reason "abort" and its pages are freed."""
        self._inbox.put(Cancel(request_id))

    def update_params(self, params: Params) -> None:
        """Swap the weights between two steps (e.g. after an RL update) and clear the prefix
        cache. Running requests go on with the new weights. Blocks until the swap is done."""
        self._ask(SwapParams(params))

    def call(self, fn: Callable[[Params], Any]) -> Any:
        """`fn(weights)` run on the engine thread between two steps, with the weights the engine
        decodes with (read them, don't change them), and its result; blocks until done. Torch
        work of the process stays on the one compute thread (e.g. `forward` to score a prompt)."""
        return self._ask(Call(fn)).result

    def load_adapter(self, name: str, source: AdapterSource) -> AdapterInfo:
        """Load a LoRA adapter under `name`, for requests that name it (`adapter=name`), between
        two steps; running requests go on unchanged. source: a folder (PEFT's
        adapter_config.json + adapter_model.safetensors, or a `just train` run folder), read on
        the engine thread, or (lora params, LoraConfig) in memory. Raises AdapterMismatch
        naming the module and shapes that do not fit the base model or the engine's adapter
        stack (EngineConfig.max_adapter_rank, adapter_targets), AdapterError for a name already
        loaded, no free slot (max_adapters) or a folder that cannot be read."""
        if isinstance(source, str | PathLike):
            path = source
            dtype, device = DTYPES[self.config.dtype], self.config.device

            def read() -> tuple[dict, LoraConfig]:
                return load_lora(path, self.cfg, dtype, device)
        elif isinstance(source, tuple) and len(source) == 2:
            read = lambda: source  # noqa: E731
        else:
            raise TypeError(
                "an adapter's source is a folder or (lora params, LoraConfig), got "
                f"{type(source).__name__}"
            )

        def load(state):
            state = load_adapter(state, name, *read())
            return state, state.adapters.info[name]

        return self._ask(ChangeState(load)).result

    def unload_adapter(self, name: str) -> None:
        """Unload adapter `name` between two steps; its prefix-cache pages are freed. Raises
        UnknownAdapter when it is not loaded, and AdapterInUse (with the count) while running
        or waiting requests use it: refused, not drained, so that no running request changes
        (stop sending it requests, let them finish or cancel them, then unload)."""
        self._ask(ChangeState(lambda state: (unload_adapter(state, name), None)))

    def adapters(self) -> list[AdapterInfo]:
        """The loaded adapters (name, rank, alpha, targets), in the order they were loaded."""
        return list(self._loop.adapters.values())

    @property
    def adapter_bytes(self) -> int:
        """Bytes the adapters' stack holds: max_adapters slots of max_adapter_rank over the
        adapted modules, allocated at the first load and freed when the last is unloaded."""
        return self._loop.adapter_bytes

    def stats(self) -> EngineStats:
        """Running and waiting requests, pages, prefix-cache hit rate, tokens/s and totals, as
        of the last snapshot (taken between steps, see EngineConfig.stats_interval_ms)."""
        return self._loop.snapshot

    def close(self) -> None:
        """Abort what is left and stop the engine thread."""
        if not self._closed:
            self._closed = True
            self._inbox.put(Close())
        self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ caller side

    def _ask(self, message: SwapParams | Call | ChangeState) -> SwapParams | Call | ChangeState:
        """Send a message the thread answers, and wait for the answer."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        release_thread_team()  # as _send does
        self._inbox.put(message)
        message.done.wait()
        if message.error is not None:
            raise message.error
        return message

    def _sequence(
        self,
        prompt,
        sampling: Sampling,
        fields: dict,
        request_id: str | None = None,
        adapter: str | None = None,
    ) -> Sequence:
        if self._closed:
            raise RuntimeError("the engine is closed")
        if adapter is not None and adapter not in self._loop.adapters:
            loaded = sorted(self._loop.adapters)
            raise UnknownAdapter(f"adapter {adapter!r} is not loaded (loaded: {loaded})")
        request = Request(
            request_id or f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}",
            prompt,
            with_fields(sampling, fields),
            adapter,
        )
        return new_sequence(self.cfg, self.config, self.tokenizer, request)

    def _send(self, seqs: list[Sequence], sink: Sink) -> None:
        self._waiting.admit(len(seqs), self.config.max_waiting)
        release_thread_team()  # the caller's idle team would slow the engine's (its docstring)
        self._inbox.put(Submit(seqs, sink))
