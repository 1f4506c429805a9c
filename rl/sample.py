"""One sampled response, from the draw of its prompt group to the loss: the only record it lives in.

A ``Sample`` is made when its prompt group is drawn, with its task type resolved then (budget, truncation
penalty, temperature); the rollout fills its tokens and per-token log-probs segment by segment (each segment
tagged with the weights version that sampled it), a multi-turn episode appends the environment's observations
(loss mask 0) between the model's turns, the reward phase sets its reward, and the trainer takes it as it is.
A single-turn task is a one-turn episode. ``Completion`` stays what an engine returns for one request; nothing
else changes type on the way.

Status: ``running`` (drawn, or generating in this iteration), ``paused`` (the iteration's token budget ran out:
it continues in the next one), ``finished`` (ended on its own), ``truncated`` (hit its budget, its turns or the
context: it takes its task type's truncation penalty), ``error`` (the engine refused it or its environment
failed: left out of the loss and counted).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from engines.inference.requests import Completion
from engines.inference.sampling import SamplingParams
from rl.algo.schedules import Schedule

Status = Literal["running", "paused", "finished", "truncated", "error"]
DONE: tuple[Status, ...] = ("finished", "truncated", "error")


@dataclass(frozen=True)
class TaskType:
    """What a response of one task type gets: its token budget (per turn), the reward when it hits it, its
    sampling temperature over the run."""

    name: str
    max_tokens: int
    truncation_penalty: float
    temperature: Schedule


@dataclass
class Sample:
    """One response to one prompt (see the module docstring)."""

    key: int                    # unique over the run; also the engine's request id
    group: int                  # its prompt group: the K samples of one prompt share it
    task_index: int             # its task in the run's training set (-1: made by the run itself, e.g. a critic's)
    task_type: TaskType
    prompt_ids: list[int]
    params: SamplingParams      # temperature, this turn's token budget, seed
    started: int                # the iteration it was drawn in
    response_ids: list[int] = field(default_factory=list)  # the model's tokens and the environment's, in order
    logprobs: list[float] = field(default_factory=list)    # per response token: the sampler's, 0 for the env's
    loss_mask: list[int] | None = None  # 1: the model's own token, 0: the environment's; None: all are own
    segments: list[tuple[int, int]] = field(default_factory=list)  # (first token index, weights version)
    multi_turn: bool = False
    turn_start: int = 0         # where the current turn begins in response_ids (a turn is one engine request)
    turns: int = 0              # the model's turns so far
    status: Status = "running"
    reward: float | None = None
    error: str | None = None

    @property
    def temperature(self) -> float:
        """The temperature it is sampled at, which the trainer's recompute uses too."""
        return self.params.temperature

    @property
    def done(self) -> bool:
        return self.status in DONE

    def own_tokens(self) -> int:
        """The model's own tokens in the response."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)

    def policy_logprob(self) -> float:
        """log π_old of the model's own tokens: the sum of the sampler's log-probs where the loss mask is 1."""
        if self.loss_mask is None:
            return sum(self.logprobs)
        return sum(lp for lp, m in zip(self.logprobs, self.loss_mask, strict=True) if m)

    # ---- the engine side: one request per turn ------------------------------------------------------------------

    def request(self) -> Completion:
        """The engine request of the current turn: the context so far as its prompt, this turn's tokens as the
        tokens generated (a paused turn resumes from them)."""
        cut = self.turn_start
        return Completion(list(self.response_ids[cut:]), list(self.logprobs[cut:]), None,
                          list(self.prompt_ids) + list(self.response_ids[:cut]), request_id=self.key,
                          params=self.params)

    def extended(self, c: Completion, version: int) -> Sample:
        """A copy carrying the engine's result ``c`` for the current turn: the new tokens become a segment of
        weights ``version``; the status from how the request ended (None: paused)."""
        n = len(self.response_ids) - self.turn_start
        if c.finish_reason != "error" and (len(c.token_ids) < n or
                                           c.token_ids[:n] != self.response_ids[self.turn_start:]):
            raise ValueError(f"result {c.request_id} does not continue sample {self.key}'s tokens")
        s = replace(self, segments=list(self.segments), error=c.error)
        if c.finish_reason == "error":
            s.status = "error"
            return s
        if len(c.token_ids) > n:
            new = len(c.token_ids) - n
            s.segments.append((len(self.response_ids), version))
            s.response_ids = [*self.response_ids, *c.token_ids[n:]]
            s.logprobs = [*self.logprobs, *c.logprobs[n:]]
            if s.loss_mask is not None:
                s.loss_mask = [*self.loss_mask, *[1] * new]
        s.status = "paused" if c.finish_reason is None else "truncated" if c.finish_reason == "length" else \
            "finished"
        return s

    # ---- checkpoints ----------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        """Inverse of ``to_dict`` (also after a JSON round trip)."""
        d = dict(d)
        t = dict(d["task_type"])
        d["task_type"] = TaskType(t["name"], t["max_tokens"], t["truncation_penalty"], Schedule(**t["temperature"]))
        d["params"] = SamplingParams(**d["params"])
        d["segments"] = [(int(a), int(b)) for a, b in d["segments"]]
        return cls(**d)
