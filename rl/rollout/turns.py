"""What crosses between the driver and a rollout worker in one rollout round: the new tokens, each way.

The driver holds every sample (``rl.sample.Sample``). A worker gets each of its samples' ``TurnRequest`` — the
sampling parameters and only the context it does not hold yet — and answers with a ``TurnResult`` per sample: the
tokens generated in this call and their log-probs, which the driver appends to the sample in place. So that a
multi-turn episode's next turn carries only the environment's observation, a worker keeps the contexts of its last
call's samples that may go on (``TurnRequest.keep``, multi-turn) and whose turn ended there; everything else it held
is dropped at that call (an episode that ended, a sample paused by the budget or run elsewhere now). The driver
tracks the same rule (``WorkerContexts``), so it knows what each worker holds; a worker that does not hold what a
request assumes (it was replaced) answers with the keys it lacks before generating anything, and the driver sends
those samples' whole contexts. An episode's context thus crosses to a worker once, and each token it generates
comes back once, while it stays on that worker: an n-turn episode moves O(n) turns' tokens, not n contexts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from engines.inference.base import RolloutEngine
from engines.inference.requests import Completion
from engines.inference.sampling import InvalidRequestError, SamplingParams
from rl.sample import TurnRequest, TurnResult, as_logprobs, as_tokens

__all__ = ["WorkerContexts", "generate_with_budget", "serve_turns"]


class WorkerContexts:
    """The driver's account of the contexts each rollout worker holds, over the rounds of one rollout phase."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[object, dict[int, int]]] = {}  # worker -> (its actor, key -> tokens it holds)

    def known(self, worker: int, actor: object) -> dict[int, int]:
        """Key -> context tokens that worker ``worker`` holds, while it is still the actor ``actor``."""
        was, held = self._held.get(worker, (None, {}))
        return held if was is actor else {}

    def requests(self, worker: int, actor: object, samples: Sequence) -> list[TurnRequest]:
        """Each sample's turn request to ``worker`` (the actor ``actor`` now): what it does not hold yet."""
        held = self.known(worker, actor)
        return [s.turn_request(k if 0 < (k := held.get(s.key, 0)) <= s.context_len else 0) for s in samples]

    def received(self, worker: int, actor: object, requests: Sequence[TurnRequest],
                 results: Sequence[TurnResult]) -> None:
        """What ``worker`` holds after answering ``requests`` with ``results``: the contexts of the kept samples
        whose turn ended (as ``serve_turns`` keeps them), nothing else."""
        asked = {r.key: r for r in requests}
        self._held[worker] = (actor, {r.key: asked[r.key].known + len(asked[r.key].tokens) + len(r.token_ids)
                                      for r in results if asked[r.key].keep and r.turn_ended})

    def forget(self, worker: int) -> None:
        """``worker`` holds nothing (it was replaced, or said it lacks a context)."""
        self._held.pop(worker, None)


def generate_with_budget(engine: RolloutEngine, requests: Sequence[tuple[list[int], SamplingParams, int]],
                         partials: Sequence[Completion], token_budget: int | None,
                         on_finish: Callable[[Completion], None] | None = None,
                         images: Mapping[int, Sequence] | None = None,
                         ) -> tuple[list[Completion], list[Completion]]:
    """Resume ``partials`` (first: they are older), add ``requests`` (prompt, params, request id; ``images``: the
    prompt's images by request id) and step until all finish or ``token_budget`` tokens were decoded in this call;
    returns (finished, paused).

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
                engine.add_request(prompt, params, request_id=rid, images=(images or {}).get(rid, ()))
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


def serve_turns(engine: RolloutEngine, held: dict[int, list[int]], requests: Sequence[TurnRequest],
                token_budget: int | None, version: int) -> tuple[list[TurnResult], list[int]]:
    """A worker's side of a round: generate each request's turn (those paused mid-turn first) until it ends or
    ``token_budget`` tokens were generated, the new tokens tagged with weights ``version``; returns (the results,
    in the order the engine handed them back; the keys whose context ``held`` lacks). ``held`` (key -> context
    tokens) is what the worker kept from its last call: with a key missing nothing is generated and it is left as
    it is; otherwise afterwards it holds the contexts of the kept requests whose turn ended."""
    missing = [r.key for r in requests if r.known and len(held.get(r.key, ())) != r.known]
    if missing:
        return [], missing
    contexts: dict[int, list[int]] = {}
    for r in requests:
        ctx = held.pop(r.key) if r.known else []
        ctx.extend(as_tokens(r.tokens).tolist())
        if not 0 <= r.turn <= len(ctx) or len(r.logprobs) != len(ctx) - r.turn:
            raise ValueError(f"request {r.key}: its turn starts at {r.turn} of {len(ctx)} context tokens with "
                             f"{len(r.logprobs)} log-probs")
        contexts[r.key] = ctx
    held.clear()  # what was not asked for again is no longer needed here
    asked = {r.key: r for r in requests}
    partials = [Completion(contexts[r.key][r.turn:], as_logprobs(r.logprobs).tolist(), None,
                           contexts[r.key][:r.turn], request_id=r.key, params=r.params, images=r.images)
                for r in requests if r.turn < len(contexts[r.key])]
    new = [(contexts[r.key], r.params, r.key) for r in requests if r.turn == len(contexts[r.key])]
    finished, paused = generate_with_budget(engine, new, partials, token_budget,
                                            images={r.key: r.images for r in requests if r.images})
    results = []
    for c in finished + paused:
        r, ctx = asked[c.request_id], contexts[c.request_id]
        n = len(ctx) - r.turn
        if c.finish_reason == "error":
            results.append(TurnResult(r.key, [], [], "error", c.error, version))
            continue
        if len(c.token_ids) < n or c.token_ids[:n] != ctx[r.turn:]:
            raise ValueError(f"result {c.request_id} does not continue sample {r.key}'s tokens")
        routes = None if c.routed_experts is None else c.routed_experts[r.routes_from:]
        out = TurnResult(r.key, c.token_ids[n:], c.logprobs[n:], c.finish_reason, c.error, version, routes)
        if r.keep and out.turn_ended:
            ctx.extend(c.token_ids[n:])
            held[r.key] = ctx
        results.append(out)
    return results, []
