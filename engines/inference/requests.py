"""What the inference engine knows of one request, and what it hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engines.inference.blocks import SeqBlocks
from engines.inference.sampling import SamplingParams


@dataclass
class Completion:
    """One response. ``finish_reason``: "stop" (EOS, stop token or stop string, named in
    ``stop_reason``), "length" (token budget), "error" (``error`` says why) or None (paused)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    prompt_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    error: str | None = None
    request_id: int = -1
    params: SamplingParams | None = None


@dataclass(eq=False)
class Request:
    """A request inside the engine. ``tokens``/``logprobs`` are everything generated so far (a resumed
    request's earlier tokens first); ``seq`` its KV blocks while it holds some."""

    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    matcher: Any = None  # per-sequence grammar state when params.grammar is set (engines.inference.constrained)
    seq: SeqBlocks | None = None
    #: requests with the very same tokens that take this one's prefill (the K samples of a prompt)
    followers: list[Request] = field(default_factory=list)
    order: int = 0  # admission order: the newest is preempted first

    @property
    def context(self) -> list[int]:
        """Every token of the sequence so far (prompt, then generated)."""
        return self.prompt + self.tokens

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.tokens)

    filter_kind: int = 0  # how its tokens are drawn (``engines.inference.sampling.filter_kind``)

    def completion(self, reason: str | None, stop_reason: int | str | None = None) -> Completion:
        return Completion(list(self.tokens), list(self.logprobs), reason, self.prompt, stop_reason=stop_reason,
                          request_id=self.id, params=self.params)
