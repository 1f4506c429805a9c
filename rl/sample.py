"""One sampled response, from the draw of its prompt group to the loss: the only record it lives in.

A ``Sample`` is made when its prompt group is drawn, with its task type resolved then (budget, truncation
penalty, temperature); the rollout fills its tokens and per-token log-probs segment by segment (each segment
tagged with the weights version that sampled it), a multi-turn episode appends the environment's observations
(loss mask 0) between the model's turns, the reward phase sets its reward, and the trainer takes it as it is.
A single-turn task is a one-turn episode.

Its token data are numpy arrays: ``prompt_ids`` and ``response_ids`` int64 (the trainer's ``torch.long``),
``logprobs`` float64 (the engines' Python floats exactly, so the trainer's float32 tensors and the float sums of
``policy_logprob`` are what they were with lists), ``loss_mask`` uint8, ``segments`` an (n, 2) int64 array of
(first token index, weights version). Anything assigned to these fields is converted. Tokens are appended in place
(``take``, ``observe``): each array is a view of a buffer with spare room that doubles when full, so a response of n
tokens costs O(n) over all its turns, and an array read before an append stays as it was (an append writes only
past its end).

The engines never see a ``Sample``: a rollout worker gets its ``TurnRequest`` (only the context it does not hold
yet, ``rl.rollout.turns``) and answers with a ``TurnResult`` (only the tokens it generated), which ``take`` appends.
``Completion`` stays what an engine returns for one request.

Status: ``running`` (drawn, or generating in this iteration), ``paused`` (the iteration's token budget ran out:
it continues in the next one), ``finished`` (ended on its own), ``truncated`` (hit its budget, its turns or the
context: it takes its task type's truncation penalty), ``error`` (the engine refused it or its environment
failed: left out of the loss and counted).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import numpy as np

from engines.inference.sampling import SamplingParams
from engines.model.images import ImageRef
from rl.algo.schedules import Schedule

Status = Literal["running", "paused", "finished", "truncated", "error"]
DONE: tuple[Status, ...] = ("finished", "truncated", "error")
TOKENS, LOGPROBS, MASK = np.int64, np.float64, np.uint8  # the dtypes of the token data


def as_tokens(values: Any, name: str = "token ids") -> np.ndarray:
    """``values`` as a 1-D int64 array (no copy when it already is one)."""
    a = np.asarray(values, dtype=TOKENS)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one sequence of token ids, got an array of shape {a.shape}")
    return a


def as_logprobs(values: Any, name: str = "logprobs") -> np.ndarray:
    """``values`` as a 1-D float64 array (no copy when it already is one)."""
    a = np.asarray(values, dtype=LOGPROBS)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one sequence of log-probabilities, got an array of shape {a.shape}")
    return a


def image_positions(image_token: int, ids: Any, prompt_len: int, loss_mask: Any = None) -> list[int]:
    """Where the images stand in a sample's template ids ``ids`` (prompt, then response and observations): its
    prompt's image placeholders and those of the environment's observations (loss mask 0). One the policy sampled
    (loss mask 1) is text, as the rollout engine read it."""
    return [i for i, t in enumerate(ids) if t == image_token and (
        i < prompt_len or (loss_mask is not None and i - prompt_len < len(loss_mask)
                           and not loss_mask[i - prompt_len]))]


def _mask(values: Any) -> np.ndarray | None:
    if values is None:
        return None
    a = np.asarray(values, dtype=MASK)
    if a.ndim != 1:
        raise ValueError(f"loss_mask must be one sequence of 0/1, got an array of shape {a.shape}")
    return a


def _segments(values: Any) -> np.ndarray:
    a = np.asarray(values, dtype=TOKENS)
    if a.size == 0:
        return a.reshape(0, 2)
    if a.ndim != 2 or a.shape[1] != 2:
        raise ValueError(f"segments must be (first token index, weights version) pairs, got shape {a.shape}")
    return a


_CONVERT = {"prompt_ids": lambda v: as_tokens(v, "prompt_ids"), "response_ids": lambda v: as_tokens(v, "response_ids"),
            "logprobs": as_logprobs, "loss_mask": _mask, "segments": _segments}


def _same(a: Any, b: Any) -> bool:
    """Equality that compares arrays (and dicts of them) by shape, dtype kind and values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and \
            a.dtype.kind == b.dtype.kind and bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@dataclass(frozen=True)
class TaskType:
    """What a response of one task type gets: its token budget (per turn), the reward when it hits it, its
    sampling temperature over the run."""

    name: str
    max_tokens: int
    truncation_penalty: float
    temperature: Schedule

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TaskType:
        """Inverse of ``dataclasses.asdict`` (also after a JSON round trip)."""
        return cls(d["name"], d["max_tokens"], d["truncation_penalty"], Schedule(**d["temperature"]))


@dataclass
class TurnRequest:
    """What a rollout worker needs to generate one sample's current turn, less what it already holds.

    ``tokens`` continues the first ``known`` tokens of the sample's context (prompt, then response so far) that the
    worker kept for ``key`` (``known`` 0: ``tokens`` is the whole context). The turn's own tokens start at context
    position ``turn``; ``logprobs`` are those of the turn's tokens generated already (a paused turn resumes from
    them). ``keep``: the worker keeps the context once the turn ends (a multi-turn episode's next turn continues
    it)."""

    key: int
    params: SamplingParams
    known: int
    tokens: np.ndarray
    turn: int
    logprobs: np.ndarray
    keep: bool = False
    routes_from: int = 0  # the sample holds the routes of its first ``routes_from`` context tokens already
    images: tuple[ImageRef, ...] = ()  # the prompt's images (references: the worker decodes them)


@dataclass
class TurnResult:
    """A worker's answer for one sample's turn: only the tokens generated in this call and their log-probs, how
    the request ended (``finish_reason`` as ``Completion``'s: None paused, "length" its budget, "error" refused,
    with ``error``; anything else ended on its own) and the weights ``version`` that sampled them."""

    key: int
    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str | None
    error: str | None = None
    version: int = 0
    routes: np.ndarray | None = None  # MoE: the routes of context tokens from the request's ``routes_from`` on

    def __post_init__(self) -> None:
        self.token_ids, self.logprobs = as_tokens(self.token_ids), as_logprobs(self.logprobs)

    @property
    def turn_ended(self) -> bool:
        """The turn ended (on its own or at its budget): neither paused nor refused."""
        return self.finish_reason is not None and self.finish_reason != "error"


@dataclass(eq=False)
class Sample:
    """One response to one prompt (see the module docstring). Equal to another with equal fields (arrays by
    value)."""

    key: int                    # unique over the run; also the engine's request id
    group: int                  # its prompt group: the K samples of one prompt share it
    task_index: int             # its task in the run's training set (-1: made by the run itself, e.g. a critic's)
    task_type: TaskType
    prompt_ids: np.ndarray      # int64
    params: SamplingParams      # temperature, this turn's token budget, seed
    started: int                # the iteration it was drawn in
    response_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, TOKENS))  # the model's and the env's
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, LOGPROBS))  # per response token; 0: env's
    loss_mask: np.ndarray | None = None  # uint8 per response token, 1: the model's own, 0: the env's; None: all own
    segments: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), TOKENS))  # (first index, version) rows
    multi_turn: bool = False
    turn_start: int = 0         # where the current turn begins in response_ids (a turn is one engine request)
    turns: int = 0              # the model's turns so far
    status: Status = "running"
    reward: float | None = None
    error: str | None = None
    #: MoE with routing replay: per context token the model read (prompt, then response; the last token is never
    #: read), per MoE layer, the top-k experts the sampler routed it to ([tokens, layers, k] int32), for replaying
    #: them in training (slime's ``rollout_routed_experts``). A resumed turn keeps the routes its earlier tokens were
    #: sampled with: each version segment's own.
    routed_experts: np.ndarray | None = None
    #: the prompt's images, one per image placeholder of ``prompt_ids`` (its task's, ``engines.model.images.ImageRef``):
    #: references the rollout worker and the trainer decode where they need the pixels; ``prompt_ids`` stay the
    #: chat template's ids, which the trainer expands with the model's processor (``engines.model.text.processor``)
    images: tuple[ImageRef, ...] = ()

    def __post_init__(self) -> None:
        self._room: dict[str, tuple[np.ndarray, int]] = {}  # field -> (its buffer, the length it uses)

    def __setattr__(self, name: str, value: Any) -> None:
        convert = _CONVERT.get(name)
        object.__setattr__(self, name, value if convert is None else convert(value))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    __hash__ = None  # mutable, as before

    def __getstate__(self) -> dict[str, Any]:
        # its fields only, never the spare room behind its arrays (pickles: Ray, deepcopy)
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def temperature(self) -> float:
        """The temperature it is sampled at, which the trainer's recompute uses too."""
        return self.params.temperature

    @property
    def done(self) -> bool:
        return self.status in DONE

    @property
    def context_len(self) -> int:
        """Tokens of its context: prompt and response so far."""
        return len(self.prompt_ids) + len(self.response_ids)

    def own_tokens(self) -> int:
        """The model's own tokens in the response."""
        return len(self.response_ids) if self.loss_mask is None else int(self.loss_mask.sum())

    def policy_logprob(self) -> float:
        """log π_old of the model's own tokens: the sum of the sampler's log-probs where the loss mask is 1."""
        # Python's sum over Python floats in token order: the very number the list-based record gave
        if self.loss_mask is None:
            return sum(self.logprobs.tolist())
        return sum(lp for lp, m in zip(self.logprobs.tolist(), self.loss_mask.tolist(), strict=True) if m)

    # ---- the engine side: one request per turn ------------------------------------------------------------------

    def turn_request(self, known: int = 0) -> TurnRequest:
        """The request of its current turn for a worker that holds the first ``known`` tokens of its context."""
        p, cut = len(self.prompt_ids), self.turn_start
        if not 0 <= known <= self.context_len:
            raise ValueError(f"sample {self.key} has {self.context_len} tokens of context; a worker cannot hold "
                             f"{known}")
        tokens = self.response_ids[known - p:] if known >= p else \
            np.concatenate((self.prompt_ids[known:], self.response_ids))
        return TurnRequest(self.key, self.params, known, tokens, p + cut, self.logprobs[cut:], self.multi_turn,
                           0 if self.routed_experts is None else len(self.routed_experts), self.images)

    def take(self, r: TurnResult) -> None:
        """Append the engine's result ``r`` for the current turn in place: the new tokens become a segment of
        weights ``r.version``; the status from how the request ended (None: paused)."""
        if r.key != self.key:
            raise ValueError(f"result {r.key} is not sample {self.key}'s")
        if self.done:
            raise ValueError(f"sample {self.key} already ended ({self.status})")
        if len(r.logprobs) != len(r.token_ids):
            raise ValueError(f"result {r.key} has {len(r.token_ids)} tokens, {len(r.logprobs)} logprobs")
        self.error = r.error
        if r.finish_reason == "error":
            self.status = "error"
            return
        new = len(r.token_ids)
        if r.routes is not None and len(r.routes):
            if self.routed_experts is None:
                self.routed_experts = np.zeros((0, *r.routes.shape[1:]), np.int32)
            self._append("routed_experts", np.asarray(r.routes, np.int32))
        if new:
            self._append("segments", np.array([[len(self.response_ids), r.version]], TOKENS))
            self._append("response_ids", r.token_ids)
            self._append("logprobs", r.logprobs)
            if self.loss_mask is not None:
                self._append("loss_mask", np.ones(new, MASK))
        self.status = "paused" if r.finish_reason is None else "truncated" if r.finish_reason == "length" else \
            "finished"

    def restart(self) -> None:
        """Forget a single-turn sample's tokens so far: it is generated again from its prompt, under the weights the
        replicas hold now (``rollout.on_update: abort``)."""
        if self.multi_turn or self.done:
            raise ValueError(f"sample {self.key}: only a single-turn sample still generating starts again")
        self._room = {}
        self.response_ids, self.logprobs = np.zeros(0, TOKENS), np.zeros(0, LOGPROBS)
        self.segments, self.status = np.zeros((0, 2), TOKENS), "running"
        self.routed_experts = None

    def oldest_version(self) -> int | None:
        """The version of the oldest weights that sampled any of its tokens (None: no token yet)."""
        return int(self.segments[:, 1].min()) if len(self.segments) else None

    def observe(self, token_ids: Any) -> None:
        """Append the environment's observation in place (log-prob 0, loss mask 0): the next turn starts after it."""
        ids = as_tokens(token_ids, "observation")
        if self.loss_mask is None:  # every token so far was the model's own
            self.loss_mask = np.ones(len(self.response_ids), MASK)
        self._append("response_ids", ids)
        self._append("logprobs", np.zeros(len(ids), LOGPROBS))
        self._append("loss_mask", np.zeros(len(ids), MASK))
        self.turn_start = len(self.response_ids)

    def _append(self, name: str, values: np.ndarray) -> None:
        """Append ``values`` to the array field ``name``: into the spare room of its buffer when the field is still
        the buffer's used part, else into a new buffer of twice the size. Nothing already read is written."""
        cur = getattr(self, name)
        n, k = len(cur), len(values)
        buf, used = self._room.get(name, (None, -1))
        if buf is None or used != n or cur.base is not buf or cur.ctypes.data != buf.ctypes.data or n + k > len(buf):
            buf = np.empty((max(2 * (n + k), 16), *cur.shape[1:]), cur.dtype)
            buf[:n] = cur
        buf[n:n + k] = values
        self._room[name] = (buf, n + k)
        object.__setattr__(self, name, buf[:n + k])

    # ---- checkpoints (the earlier JSON format; ``rl.rollout.partial`` writes arrays) ------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (the checkpoint format before arrays)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["task_type"], d["params"] = asdict(self.task_type), asdict(self.params)
        d["images"] = [im.to_json() for im in self.images]
        return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        """Inverse of ``to_dict`` (also after a JSON round trip, and of checkpoints written before arrays)."""
        d = dict(d)
        d["task_type"] = TaskType.from_dict(d["task_type"])
        d["params"] = SamplingParams(**d["params"])
        if d.get("routed_experts") is not None:
            d["routed_experts"] = np.asarray(d["routed_experts"])
        d.pop("multimodal_inputs", None)  # a field of checkpoints before images, never filled
        d["images"] = tuple(ImageRef.from_json(im, f"sample {d['key']} image {j}")
                            for j, im in enumerate(d.get("images") or ()))
        return cls(**d)
