"""Partial rollout (Kimi K1.5/K2): a fixed rollout token budget per iteration.

Trajectories still generating when the budget is spent are paused with their tokens and
per-token logprobs, and continue in the next iteration under the new weights; each stretch of
tokens is a segment tagged with the weights version that sampled it, so π_old of every token is
the policy that actually drew it. Trajectories older than ``max_age`` iterations are dropped, and
a prompt group is handed to the trainer once every remaining sample of it has finished. Samples are
``rl.sample.Sample`` records; a multi-turn episode's turns go through the same buffer and budget (its
environment stays with the driver, ``rl.rollout.multiturn``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engines.inference.base import RolloutEngine
from engines.inference.requests import Completion
from engines.inference.sampling import InvalidRequestError, SamplingParams
from rl.sample import Sample, TaskType

__all__ = ["PartialRolloutBuffer", "advance", "generate_with_budget"]


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


def advance(engine: RolloutEngine, samples: Sequence[Sample], token_budget: int | None,
            version: int) -> list[Sample]:
    """Generate the current turn of ``samples`` (those paused mid-turn first: they are older) until each turn ends
    or ``token_budget`` tokens were generated; returns them, updated (``Sample.extended``: the tokens generated
    here are one more segment, of weights ``version``; status "paused" for those paused again). The inputs are not
    modified."""
    asked = [s.request() for s in samples]
    partials = [c for c in asked if c.token_ids]
    requests = [(c.prompt_ids, c.params, c.request_id) for c in asked if not c.token_ids]
    finished, paused = generate_with_budget(engine, requests, partials, token_budget)
    held = {s.key: s for s in samples}
    return [held[c.request_id].extended(c, version) for c in finished + paused]


_STAT_KEYS = ("resumed", "dropped")


class PartialRolloutBuffer:
    """The samples of prompt groups that are not complete yet, across iterations.

    Per iteration: ``pending(it)`` (drops the too old, lists what to run), generate, ``record`` the results,
    ``pop_complete()`` the groups to train on. Counters for ``stats()`` are reset by the first ``pending`` call of
    each new iteration. Multi-turn samples between turns are held here too; their environments are not (they live
    with the driver's episode runner), so a checkpoint cannot carry them: ``drop_in_flight_episodes`` ends them
    before a save, in every run alike, which keeps a resumed run exact.
    """

    def __init__(self, max_age: int) -> None:
        if max_age < 0:
            raise ValueError(f"max_age must be >= 0, got {max_age}")
        self.max_age = max_age
        self._groups: dict[int, list[Sample]] = {}
        self._by_key: dict[int, Sample] = {}
        self._counts = dict.fromkeys(_STAT_KEYS, 0)
        self._iteration: int | None = None  # iteration the counters belong to

    def add_group(self, samples: Sequence[Sample]) -> None:
        """Register the new samples of one prompt group."""
        if not samples:
            raise ValueError("a group needs at least one sample")
        group = samples[0].group
        keys = [s.key for s in samples]
        if any(s.group != group for s in samples):
            raise ValueError(f"samples of one group must share its id; got {sorted({s.group for s in samples})}")
        if group in self._groups:
            raise ValueError(f"group {group} is already in the buffer")
        if len(set(keys)) != len(keys) or any(k in self._by_key for k in keys):
            raise ValueError(f"sample keys must be unique: {keys}")
        self._groups[group] = list(samples)
        self._by_key.update((s.key, s) for s in samples)

    def _drop(self, keys: set[int]) -> list[Sample]:
        """Remove the samples ``keys``; a group goes on with its other samples, or is gone if none is left."""
        dropped = [self._by_key.pop(k) for k in sorted(keys)]
        for g in {s.group for s in dropped}:
            keep = [s for s in self._groups[g] if s.key not in keys]
            if keep:
                self._groups[g] = keep
            else:
                del self._groups[g]
        self._counts["dropped"] += len(dropped)
        return dropped

    def pending(self, iteration: int) -> tuple[list[Sample], list[Sample]]:
        """(to run, dropped): unfinished samples, oldest first, and those removed because
        ``iteration - started > max_age``. Starts the counters of ``iteration`` if new."""
        if iteration != self._iteration:
            self._iteration = iteration
            self._counts = dict.fromkeys(_STAT_KEYS, 0)
        unfinished = [s for g in sorted(self._groups) for s in self._groups[g] if not s.done]
        dropped = self._drop({s.key for s in unfinished if iteration - s.started > self.max_age})
        gone = {s.key for s in dropped}
        run = sorted((s for s in unfinished if s.key not in gone), key=lambda s: (s.started, s.key))
        self._counts["resumed"] += sum(s.started < iteration for s in run)
        return run, dropped

    def record(self, results: Sequence[Sample]) -> None:
        """Take generated samples back (matched by key; see ``advance``): each must continue the held one's tokens
        and segments, which the held sample then takes (in place: the buffer's samples are the records)."""
        for r in results:
            s = self._by_key.get(r.key)
            if s is None:
                raise KeyError(f"no sample with key {r.key} in the buffer")
            if s.done:
                raise ValueError(f"sample {s.key} already ended ({s.status})")
            if len(r.logprobs) != len(r.response_ids):
                raise ValueError(f"result {r.key} has {len(r.response_ids)} tokens, {len(r.logprobs)} logprobs")
            n = len(s.response_ids)
            if r.status != "error" and (r.response_ids[:n] != s.response_ids or
                                        r.segments[:len(s.segments)] != s.segments):
                raise ValueError(f"result {r.key} does not continue sample {s.key}'s tokens")
            s.response_ids, s.logprobs, s.segments = list(r.response_ids), list(r.logprobs), list(r.segments)
            s.loss_mask = None if r.loss_mask is None else list(r.loss_mask)
            s.status, s.error = r.status, r.error

    def get(self, key: int) -> Sample:
        """The sample ``key`` as held now."""
        return self._by_key[key]

    def pop_complete(self) -> list[list[Sample]]:
        """Remove and return the groups whose every remaining sample has ended, by group id."""
        out = []
        for g in sorted(self._groups):
            if all(s.done for s in self._groups[g]):
                members = self._groups.pop(g)
                for s in members:
                    del self._by_key[s.key]
                out.append(members)
        return out

    def drop_in_flight_episodes(self) -> list[Sample]:
        """Remove the multi-turn samples not yet ended (their environments cannot be saved); returns them."""
        return self._drop({k for k, s in self._by_key.items() if s.multi_turn and not s.done})

    def in_flight_groups(self) -> int:
        """Groups held: some sample still unfinished, or complete but not yet popped."""
        return len(self._groups)

    def stats(self) -> dict[str, int]:
        """The current iteration's counters (reset by its first ``pending``): ``resumed`` samples drawn in an
        earlier iteration that ran in this one, ``dropped`` for age or a checkpoint; and, now: ``paused``, the
        samples waiting for the next iteration (mid-turn, or a multi-turn episode between turns), and
        ``waiting_groups`` (call after ``pop_complete``)."""
        paused = sum(not s.done for s in self._by_key.values())
        return {"paused": paused, **self._counts, "waiting_groups": len(self._groups)}

    def state_dict(self) -> dict:
        """JSON-serialisable state, for checkpoints."""
        return {"max_age": self.max_age, "iteration": self._iteration, "counts": dict(self._counts),
                "groups": [[s.to_dict() for s in self._groups[g]] for g in sorted(self._groups)]}

    def load_state_dict(self, state: dict, type_of: Callable[[int], TaskType] | None = None) -> None:
        """Replace this buffer's contents with a ``state_dict`` (also after a JSON round trip). Checkpoints written
        before samples carried their task type hold trajectories; ``type_of(task_index)`` types them."""
        self.max_age = int(state["max_age"])
        self._iteration = state["iteration"]
        self._counts = {k: int(state["counts"].get(k, 0)) for k in _STAT_KEYS}
        self._groups, self._by_key = {}, {}
        for members in state["groups"]:
            self.add_group([Sample.from_dict(d) if "task_type" in d else _from_trajectory(d, type_of)
                            for d in members])


def _from_trajectory(d: dict, type_of: Callable[[int], TaskType] | None) -> Sample:
    """A paused trajectory of an earlier checkpoint format as a sample."""
    if type_of is None:
        raise ValueError("a checkpoint of the earlier format needs type_of to give its trajectories a task type")
    status = "paused" if d["finish_reason"] is None else "error" if d["finish_reason"] == "error" else \
        "truncated" if d["finish_reason"] == "length" else "finished"
    return Sample(d["key"], d["group"], d["task_index"], type_of(d["task_index"]), list(d["prompt_ids"]),
                  SamplingParams(**d["params"]), d["started"], list(d["token_ids"]), list(d["logprobs"]),
                  segments=[(int(a), int(b)) for a, b in d["segments"]], status=status, error=d.get("error"))
