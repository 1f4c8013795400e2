"""One request's whole state while the engine holds it: its tokens, how it samples and stops,
where its text stands, and the pages that hold its K/V.

The scheduler reads and writes the page fields (`pages`, `computed`, `arrival`, ...); the
engine step writes the tokens and the text fields. A sequence belongs to the engine state it
was added to and changes with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from astrai.infer.sampling import SamplingParams

RELEASED = -1  # the entry in Sequence.pages of a page given back (any valid page stands in)


@dataclass(eq=False)
class Sequence:
    id: str
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    # how it samples and when it stops
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    max_len: int = 0  # prompt + max_tokens; 0: no limit (the scheduler's own tests)
    # the LoRA adapter it runs with (None: the base model) and the prefix cache's key for its
    # K/V: the adapter's load, so that K/V of an adapter unloaded and loaded again, or of
    # another adapter, never match (set when it joins an engine state)
    adapter: str | None = None
    prefix_key: object = None
    # its text
    decoder: object | None = None  # the tokenizer's stream decoder
    unsent_text: str = ""  # decoded text not yet emitted (it could start a stop string)
    matcher: object | None = None  # the grammar's state when sampling.constraint is set
    # its pages (the scheduler's)
    arrival: int = 0  # admission order; the newest running sequence is preempted first
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # leading tokens whose K/V are in `pages`
    # leading pages given back once wholly behind the window of a window-only model; their
    # entries in `pages` are RELEASED, so page counts still follow positions
    released: int = 0
    cached_tokens: int = -1  # prompt tokens the prefix cache gave at first admission
    preemptions: int = 0
    cacheable: bool = True  # False once its K/V may come from weights since replaced

    @property
    def pending(self) -> int:
        """Tokens still to feed; 1 means the sequence is decoding."""
        return len(self.tokens) - self.computed

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


def page_table(seqs: list[Sequence], device: torch.device | str = "cpu") -> torch.Tensor:
    """Each sequence's pages as rows of a [B, W] table, padded with page 0; a page given back
    (RELEASED) reads as page 0 too, which the window mask hides like the padding."""
    width = max(len(seq.pages) for seq in seqs)
    table = torch.tensor([seq.pages + [0] * (width - len(seq.pages)) for seq in seqs])
    return table.clamp_(min=0).to(device)
