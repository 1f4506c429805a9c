"""Partial rollout (Kimi K1.5/K2): a fixed rollout token budget per iteration.

Trajectories still generating when the budget is spent are paused with their tokens and
per-token logprobs, and continue in the next iteration under the new weights; each stretch of
tokens is a segment tagged with the weights version that sampled it, so π_old of every token is
the policy that actually drew it. Trajectories older than ``max_age`` iterations are dropped, and
a prompt group is handed to the trainer once every remaining sample of it has finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from engines.inference.base import RolloutEngine
from engines.inference.requests import Completion
from engines.inference.sampling import InvalidRequestError, SamplingParams

__all__ = ["PartialRolloutBuffer", "Trajectory", "advance", "generate_with_budget"]


def generate_with_budget(engine: RolloutEngine, requests: Sequence[tuple[list[int], SamplingParams, int]],
                         partials: Sequence[Completion], token_budget: int | None,
                         on_finish: Callable[[Completion], None] | None = None,
                         ) -> tuple[list[Completion], list[Completion]]:
    """Resume ``partials`` (first: they are older), add ``requests`` (prompt, params, request id) and step
    until all finish or ``token_budget`` tokens were decoded in this call; returns (finished, paused).

    The budget is checked between engine steps, so one step may overshoot it by fewer tokens than
    there are running requests. Paused completions (finish_reason None) carry all their tokens so far
    and go back into a later call's ``partials``. A request the engine refuses comes back finished
    with finish_reason "error" (a partial keeps its tokens). ``on_finish`` sees every finished one.
    """
    if engine.has_unfinished():
        raise RuntimeError("the engine already has unfinished requests; pause() them first")
    if token_budget is not None and token_budget < 0:
        raise ValueError(f"token_budget must be >= 0 or None, got {token_budget}")
    ids = [c.request_id for c in partials] + [rid for _, _, rid in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    for c in partials:
        # a finished completion here is a caller bug, not a request the engine cannot serve
        if c.finish_reason is not None or c.params is None:
            raise ValueError(f"request {c.request_id} is not a paused completion (finish_reason "
                             f"{c.finish_reason!r}, params {c.params!r})")

    finished: list[Completion] = []

    def done(c: Completion) -> None:
        finished.append(c)
        if on_finish is not None:
            on_finish(c)

    try:
        for c in partials:
            try:
                engine.resume([c])
            except InvalidRequestError as e:
                done(Completion(list(c.token_ids), list(c.logprobs), "error", list(c.prompt_ids), error=str(e),
                                request_id=c.request_id, params=c.params))
        for prompt, params, rid in requests:
            try:
                engine.add_request(prompt, params, request_id=rid)
            except InvalidRequestError as e:
                done(Completion([], [], "error", list(prompt), error=str(e), request_id=rid, params=params))
        start = engine.generated
        while engine.has_unfinished() and (token_budget is None or engine.generated - start < token_budget):
            out = engine.step()
            for c in out:
                done(c)
    except BaseException:
        engine.pause()  # leave the engine empty whatever happened; the caller gets the exception
        raise
    return finished, engine.pause()


@dataclass
class Trajectory:
    """One sample of a prompt group, possibly generated over several iterations (segments)."""

    key: int                    # unique id, also the engine request id
    group: int                  # unique id of its prompt group (the K samples of one prompt share it)
    task_index: int             # index of its task in the caller's task list
    prompt_ids: list[int]
    params: SamplingParams
    started: int                # iteration in which it was first sampled
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # per token, from the weights of its segment
    segments: list[tuple[int, int]] = field(default_factory=list)  # (first token index, weights version)
    finish_reason: str | None = None  # None while unfinished; "error" when the engine refused it
    error: str | None = None

    def extended(self, c: Completion, version: int) -> Trajectory:
        """A copy carrying the engine's result ``c`` for it (its tokens so far, a resumed request's earlier ones
        first): the new tokens become a segment of weights ``version``; finish state from ``c``."""
        n = len(self.token_ids)
        if c.finish_reason != "error" and (len(c.token_ids) < n or c.token_ids[:n] != self.token_ids):
            raise ValueError(f"result {c.request_id} does not continue trajectory {self.key}'s tokens")
        t = replace(self, segments=list(self.segments), finish_reason=c.finish_reason, error=c.error)
        if c.finish_reason != "error" and len(c.token_ids) > n:
            t.token_ids, t.logprobs = list(c.token_ids), list(c.logprobs)
            t.segments.append((n, version))
        return t

    def to_dict(self) -> dict:
        """JSON-serialisable form (SamplingParams as a dict)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        """Inverse of ``to_dict`` (also after a JSON round trip)."""
        d = dict(d)
        d["params"] = SamplingParams(**d["params"])
        d["segments"] = [(int(a), int(b)) for a, b in d["segments"]]
        return cls(**d)


def advance(engine: RolloutEngine, trajectories: Sequence[Trajectory], token_budget: int | None,
            version: int) -> list[Trajectory]:
    """Generate for ``trajectories`` (paused ones first: they are older) until each finishes or ``token_budget``
    tokens were generated; returns them, updated: the tokens generated here are one more segment, of weights
    ``version``, and ``finish_reason`` is None for those paused again. The inputs are not modified."""
    partials = [Completion(list(t.token_ids), list(t.logprobs), None, list(t.prompt_ids), request_id=t.key,
                           params=t.params) for t in trajectories if t.token_ids]
    requests = [(list(t.prompt_ids), t.params, t.key) for t in trajectories if not t.token_ids]
    finished, paused = generate_with_budget(engine, requests, partials, token_budget)
    held = {t.key: t for t in trajectories}
    return [held[c.request_id].extended(c, version) for c in finished + paused]


_STAT_KEYS = ("paused", "resumed", "dropped")


class PartialRolloutBuffer:
    """The trajectories of prompt groups that are not complete yet, across iterations.

    Per iteration: ``pending(it)`` (drops the too old, lists what to run), generate, ``record``
    the results, ``pop_complete()`` the groups to train on. Counters for ``stats()`` are reset by
    the first ``pending`` call of each new iteration.
    """

    def __init__(self, max_age: int) -> None:
        if max_age < 0:
            raise ValueError(f"max_age must be >= 0, got {max_age}")
        self.max_age = max_age
        self._groups: dict[int, list[Trajectory]] = {}
        self._by_key: dict[int, Trajectory] = {}
        self._counts = dict.fromkeys(_STAT_KEYS, 0)
        self._iteration: int | None = None  # iteration the counters belong to

    def add_group(self, trajs: Sequence[Trajectory]) -> None:
        """Register the new trajectories of one prompt group."""
        if not trajs:
            raise ValueError("a group needs at least one trajectory")
        group = trajs[0].group
        keys = [t.key for t in trajs]
        if any(t.group != group for t in trajs):
            raise ValueError(f"trajectories of one group must share its id; got {sorted({t.group for t in trajs})}")
        if group in self._groups:
            raise ValueError(f"group {group} is already in the buffer")
        if len(set(keys)) != len(keys) or any(k in self._by_key for k in keys):
            raise ValueError(f"trajectory keys must be unique: {keys}")
        self._groups[group] = list(trajs)
        self._by_key.update((t.key, t) for t in trajs)

    def pending(self, iteration: int) -> tuple[list[Trajectory], list[Trajectory]]:
        """(to run, dropped): unfinished trajectories, oldest first, and those removed because
        ``iteration - started > max_age``. Starts the counters of ``iteration`` if new."""
        if iteration != self._iteration:
            self._iteration = iteration
            self._counts = dict.fromkeys(_STAT_KEYS, 0)
        run, dropped = [], []
        for g in sorted(self._groups):
            members = self._groups[g]
            unfinished = [t for t in members if t.finish_reason is None]
            old = {t.key for t in unfinished if iteration - t.started > self.max_age}
            run += [t for t in unfinished if t.key not in old]
            if old:
                dropped += [t for t in unfinished if t.key in old]
                for k in old:
                    del self._by_key[k]
                # the group goes on with its other samples, or is gone if none is left
                keep = [t for t in members if t.key not in old]
                if keep:
                    self._groups[g] = keep
                else:
                    del self._groups[g]
        self._counts["dropped"] += len(dropped)
        run.sort(key=lambda t: (t.started, t.key))
        return run, dropped

    def record(self, results: Sequence[Trajectory], iteration: int) -> None:
        """Take generated trajectories back (matched by key; see ``advance``): each must continue the held
        one's tokens. ``iteration`` is for the counters."""
        for r in results:
            t = self._by_key.get(r.key)
            if t is None:
                raise KeyError(f"no trajectory with key {r.key} in the buffer")
            if t.finish_reason is not None:
                raise ValueError(f"trajectory {t.key} already finished ({t.finish_reason})")
            if len(r.logprobs) != len(r.token_ids):
                raise ValueError(f"result {r.key} has {len(r.token_ids)} tokens, {len(r.logprobs)} logprobs")
            n = len(t.token_ids)
            if r.finish_reason != "error" and (r.token_ids[:n] != t.token_ids or r.segments[:len(t.segments)]
                                               != t.segments):
                raise ValueError(f"result {r.key} does not continue trajectory {t.key}'s tokens")
            t.token_ids, t.logprobs, t.segments = list(r.token_ids), list(r.logprobs), list(r.segments)
            t.finish_reason, t.error = r.finish_reason, r.error
            if t.started < iteration:
                self._counts["resumed"] += 1
            if r.finish_reason is None:
                self._counts["paused"] += 1

    def pop_complete(self) -> list[list[Trajectory]]:
        """Remove and return the groups whose every remaining trajectory has finished, by group id."""
        out = []
        for g in sorted(self._groups):
            if all(t.finish_reason is not None for t in self._groups[g]):
                members = self._groups.pop(g)
                for t in members:
                    del self._by_key[t.key]
                out.append(members)
        return out

    def in_flight_groups(self) -> int:
        """Groups held: some sample still unfinished, or complete but not yet popped."""
        return len(self._groups)

    def stats(self) -> dict[str, int]:
        """Counters of the current iteration (reset by its first ``pending``): ``paused`` results
        left unfinished, ``resumed`` results of trajectories started in an earlier iteration, ``dropped``
        for age; plus ``waiting_groups``, the groups held right now (call after ``pop_complete``)."""
        return {**self._counts, "waiting_groups": len(self._groups)}

    def state_dict(self) -> dict:
        """JSON-serialisable state, for checkpoints."""
        return {"max_age": self.max_age, "iteration": self._iteration, "counts": dict(self._counts),
                "groups": [[t.to_dict() for t in self._groups[g]] for g in sorted(self._groups)]}

    def load_state_dict(self, state: dict) -> None:
        """Replace this buffer's contents with a ``state_dict`` (also after a JSON round trip)."""
        self.max_age = int(state["max_age"])
        self._iteration = state["iteration"]
        self._counts = {k: int(state["counts"][k]) for k in _STAT_KEYS}
        self._groups, self._by_key = {}, {}
        for members in state["groups"]:
            self.add_group([Trajectory.from_dict(d) for d in members])
