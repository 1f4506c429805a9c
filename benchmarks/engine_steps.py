"""One timed generation of the native engine, step by step: what each step computed and how long it took, the
read roofline of every step, the body of the run apart from its ramp and tail, and the CUDA-graph check.

Each step is timed on the host from the end of the one before: a step ends with its one read of the device (the
sampled tokens), so the device is idle at each boundary and the times add up to the window's (the forwards of a
multi-step read, ``decode_steps``, are each a step here, sharing its time equally). Per step: ``decode``
(rows decoding), ``sampled`` (tokens made: decode rows and prompts finishing their prefill), ``chunks`` and
``prefill_tokens`` (prompt chunks computed), ``context_tokens`` (keys and values the step's queries attend to: each
decode row's whole context, each chunk's positions up to its end) and ``seconds``. ``--step-log PATH`` writes them as
JSON lines.

The **body** of a run is its steps with at least ``BODY_FRACTION`` of the most rows that ever decoded at once: the
full batch a rollout is sized for. Steps before the first of them are the **ramp** (prefills filling the batch),
those after it with fewer rows the **tail** (the long responses left after the short ones ended), where a read-bound
step reads the weights for few tokens. Each part reports its tokens, seconds, tok/s and roofline fraction.

The engine captures its decode graphs at start; a capture inside the timed window means a batch shape the start
missed, its capture time counted as decoding. ``captures_in_window`` counts them (``engine.stats()`` before and after
the window); on a GPU with graphs on any is a failure of this benchmark's own check: printed, and named in the
record's ``checks_failed``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.roofline import roofline_fields, step_read_bytes, weight_read_bytes
from benchmarks.timing import say
from engines.device import synchronize
from engines.inference.kv_cache import bytes_per_token
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.inference.scheduler import StepPlan

#: a step is in the body when its decode rows are at least this fraction of the run's most
BODY_FRACTION = 0.9
#: seconds between progress lines on stderr during a timed run
PROGRESS_S = 10.0


@dataclass
class StepRecord:
    """One engine step (see the module)."""

    decode: int
    sampled: int
    chunks: int
    prefill_tokens: int
    context_tokens: int
    seconds: float = 0.0


@dataclass
class TimedRun:
    """A timed generation: wall seconds of the window, token ids per request (in the order given), its steps, the
    CUDA graphs captured and the requests preempted inside the window."""

    seconds: float
    outputs: list[list[int]]
    steps: list[StepRecord]
    captures_in_window: int
    preemptions: int


def _summary(plan: StepPlan) -> StepRecord:
    decode_rows = plan.sampled[: plan.decode]
    return StepRecord(decode=plan.decode, sampled=len(plan.sampled), chunks=len(plan.chunks),
                      prefill_tokens=sum(c.end - c.start for c in plan.chunks),
                      context_tokens=sum(r.context_len for r in decode_rows) + sum(c.end for c in plan.chunks))


@contextmanager
def _watching(engine: InferenceEngine, seen: list[StepRecord]):
    """Note each plan the engine's model runner executes (read before the step changes its requests); a multi-step
    plan is noted once per forward, each row's context a token longer each time."""
    runner = engine.runner
    execute, execute_ahead = runner.execute, runner.execute_ahead

    def watched(plan: StepPlan):
        if plan.computes:
            seen.append(_summary(plan))
        return execute(plan)

    def watched_ahead(plan: StepPlan, steps: int):
        first = _summary(plan)
        seen.extend(replace(first, context_tokens=first.context_tokens + i * plan.decode) for i in range(steps))
        return execute_ahead(plan, steps)

    runner.execute, runner.execute_ahead = watched, watched_ahead
    try:
        yield
    finally:
        del runner.execute, runner.execute_ahead  # the class's methods again


def timed_generate(engine: InferenceEngine, prompts: list[list[int]], params: list[SamplingParams]) -> TimedRun:
    """Run ``prompts`` to completion one engine step at a time, timing each step and the whole window."""
    before = engine.stats()
    out: dict[int, list[int]] = {}
    steps: list[StepRecord] = []
    synchronize(engine.device)
    t0 = last = time.perf_counter()
    order = [engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    told = t0
    with _watching(engine, steps):
        while engine.has_unfinished():
            seen = len(steps)
            for c in engine.step():
                out[c.request_id] = c.token_ids
            now = time.perf_counter()
            if len(steps) > seen:  # a step that only moved rows or copied blocks adds its time to the next one
                for s in steps[seen:]:  # the forwards of one read share its time
                    s.seconds = (now - last) / (len(steps) - seen)
                last = now
            if now - told > PROGRESS_S:  # a run cut at its time limit shows how far it got
                say("engine", f"{len(steps)} steps, {len(out)} of {len(order)} requests done")
                told = now
    synchronize(engine.device)
    seconds = time.perf_counter() - t0
    after = engine.stats()
    return TimedRun(seconds, [out[r] for r in order], steps,
                    after["cuda_graph_captures"] - before["cuda_graph_captures"],
                    after["preemptions"] - before["preemptions"])


def write_step_log(path: str | Path, steps: list[StepRecord], **context) -> None:
    """Append ``steps`` to ``path`` as JSON lines, each with ``context`` (what ran), ``run`` (when and in which
    process: runs appended to one file stay apart) and its index."""
    run = f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime())}-{os.getpid()}"
    with open(path, "a") as f:
        for i, s in enumerate(steps):
            f.write(json.dumps({**context, "run": run, "step": i, **asdict(s), "seconds": round(s.seconds, 6)}) + "\n")


def parts(steps: list[StepRecord], weights: tuple[int, int], kv_per_token: int, read_bps: float, name: str,
          fraction: float = BODY_FRACTION) -> dict[str, dict]:
    """Ramp, body and tail of a run (see the module), each with its steps, mean decode rows, tokens, seconds,
    tok/s and read-roofline figures."""
    peak = max((s.decode for s in steps), default=0)
    body = [s.decode >= fraction * peak and peak > 0 for s in steps]
    first = body.index(True) if any(body) else len(steps)
    split = {"ramp": steps[:first],
             "body": [s for s, b in zip(steps, body, strict=True) if b],
             "tail": [s for s, b in zip(steps[first:], body[first:], strict=True) if not b]}
    return {k: part(v, weights, kv_per_token, read_bps, name) for k, v in split.items()}


def part(steps: list[StepRecord], weights: tuple[int, int], kv_per_token: int, read_bps: float, name: str) -> dict:
    """The figures of a list of steps: count, mean decode rows, tokens, seconds, tok/s and the read roofline."""
    tokens, seconds = sum(s.sampled for s in steps), sum(s.seconds for s in steps)
    read = sum(read_bytes(s, weights, kv_per_token) for s in steps)
    rec = {"steps": len(steps), "mean_rows": round(sum(s.decode for s in steps) / len(steps), 1) if steps else 0,
           "tokens": tokens, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 1) if seconds else None}
    if not steps:
        return rec
    roof = roofline_fields(tokens, seconds, read, read_bps, name)
    return {**rec, **{k: v for k, v in roof.items() if k not in ("read_gb_s", "nominal_read_gb_s")}}  # the run's


def read_bytes(step: StepRecord, weights: tuple[int, int], kv_per_token: int) -> int:
    """What ``step`` had to read (``benchmarks.roofline.step_read_bytes``)."""
    return step_read_bytes(weights, step.decode + step.prefill_tokens, step.context_tokens, kv_per_token)


def run_record(engine: InferenceEngine, run: TimedRun, read_bps: float, name: str, graphs: bool) -> dict:
    """The record's fields of a timed run: tok/s, the read roofline of the whole window, its ramp, body and tail,
    and the CUDA-graph check (``graphs``: the engine was asked for graphs on a GPU)."""
    weights = weight_read_bytes(engine.model)
    per_token = bytes_per_token(engine.model.config, next(engine.model.parameters()).dtype)
    tokens = sum(map(len, run.outputs))
    read = sum(read_bytes(s, weights, per_token) for s in run.steps)
    stats = engine.stats()
    return {"engine_tok_s": round(tokens / run.seconds, 1), "engine_s": round(run.seconds, 3),
            "engine_steps": len(run.steps), "peak_rows": max((s.decode for s in run.steps), default=0),
            "preemptions": run.preemptions, **roofline_fields(tokens, run.seconds, read, read_bps, name),
            "parts": parts(run.steps, weights, per_token, read_bps, name),
            # over the engine's life: those of its start (and of any warm-up), then any in the window
            "cuda_graph_captures": stats["cuda_graph_captures"], "cuda_graphs_fallback": stats["cuda_graphs_fallback"],
            **capture_check(run.captures_in_window, graphs)}


def capture_check(captures: int, graphs: bool) -> dict:
    """``captures_in_window`` and, on a GPU with graphs on, the check that it is 0: a failure is printed on stderr
    and named in ``checks_failed`` (the run itself goes on and is recorded)."""
    rec: dict = {"captures_in_window": captures}
    if graphs and captures:
        print(f"CHECK FAILED: {captures} CUDA graph(s) captured inside the timed window: the engine met a batch "
              "shape its start did not capture, and this run's tok/s count those captures as decoding",
              file=sys.stderr, flush=True)
        rec["checks_failed"] = ["captures_in_window"]
    return rec
