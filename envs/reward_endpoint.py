"""Rewards from an HTTP endpoint: a reward model or a verifier served elsewhere (env ``endpoint``).

Request: ``POST <url>`` with a JSON body ``{"items": [ITEM, ...]}``, one item per response::

    {"id": "task id", "prompt": "the prompt text", "messages": [{"role": "user", "content": "..."}] or null,
     "response": "the model's response", "answer": "the reference answer, or empty", "meta": {...}}

Response: status 200 and ``{"rewards": [R, ...]}``, one number per item in order; optional ``"infos"`` (one object
per item, returned as the step's ``info``) and ``"errors"`` (one string or null per item). A reward that is null,
not a number, NaN or infinite fails that item only (with its error); the others keep theirs.

Batching: the episodes stepped at once in a process share one queue per endpoint; a request carries up to
``batch_size`` items and leaves when it is full or ``max_wait_s`` after its first item. Up to ``concurrency``
requests are in flight. Retries: a connection error, a timeout (``timeout_s`` per request) or status 408, 429 or
5xx is retried ``retries`` times, waiting 0.5 s, 1 s, 2 s...; another status fails at once. An item that fails
costs its episode (an environment error, counted in ``env_errors``), never a reward. ``examples/reward_server.py``
is a reference server.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from envs.base import Env, Task
from envs.http_retry import BACKOFF_S, after, post_with_retries
from envs.registry import register

IDLE_S = 30.0  # a queue's collector thread ends after this long without items (the next item starts another)


class EndpointError(RuntimeError):
    """A request to the reward endpoint failed (after its retries), or the endpoint's answer was unusable."""


@dataclass
class _Pending:
    item: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    measured: dict[str, Any] = field(default_factory=dict)

    def fail(self, error: str) -> None:
        self.error = error
        self.done.set()


class _Batcher:
    """One endpoint's queue: collects items into batches and posts them from a small pool."""

    def __init__(self, url: str, timeout_s: float, retries: int, batch_size: int, max_wait_s: float,
                 headers: dict[str, str], concurrency: int) -> None:
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.batch_size, self.max_wait_s, self.headers = batch_size, max_wait_s, headers
        self.queue: queue.Queue[_Pending] = queue.Queue()
        self.lock = threading.Lock()
        self.collector: threading.Thread | None = None
        self.concurrency = concurrency
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="reward-endpoint")

    def submit(self, item: dict[str, Any]) -> _Pending:
        pending = _Pending(item)
        with self.lock:
            self.queue.put(pending)
            if self.collector is None:
                self.collector = threading.Thread(target=self._collect, daemon=True, name="reward-endpoint-batch")
                self.collector.start()
        return pending

    def _collect(self) -> None:
        while True:
            try:
                first = self.queue.get(timeout=IDLE_S)
            except queue.Empty:
                with self.lock:  # submit() starts a new collector once this one is gone
                    if self.queue.empty():
                        self.collector = None
                        return
                continue
            batch, deadline = [first], time.monotonic() + self.max_wait_s
            while len(batch) < self.batch_size:
                remaining = deadline - time.monotonic()
                try:
                    batch.append(self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait())
                except queue.Empty:
                    break
            self.pool.submit(self._send, batch)

    def _post(self, body: bytes) -> tuple[dict[str, Any] | None, str | None, int]:
        """(reply, error, attempts made) of one request, retried as ``envs.http_retry`` says."""
        r, error, attempts = post_with_retries(self.url, timeout_s=self.timeout_s, retries=self.retries, content=body,
                                               headers={"Content-Type": "application/json", **self.headers})
        if r is None:
            return None, error, attempts
        try:
            return r.json(), None, attempts
        except ValueError:
            return None, f"{self.url} answered 200 but not JSON: {r.text[:200]!r}", attempts

    def _send(self, batch: list[_Pending]) -> None:
        try:
            body = json.dumps({"items": [p.item for p in batch]}, default=str).encode()
            started = time.monotonic()
            reply, error, attempts = self._post(body)
            if error is None:
                error = _check_reply(reply, len(batch))
            measured = {"request_s": round(time.monotonic() - started, 4), "batch_items": len(batch),
                        "attempts": attempts}
            for i, p in enumerate(batch):
                p.measured = measured
                if error is not None:
                    p.fail(after(error, attempts))
                    continue
                _deliver(p, reply, i)
        except Exception as e:  # whatever went wrong, no episode may wait forever
            for p in batch:
                if not p.done.is_set():
                    p.fail(f"{type(e).__name__}: {e}")


def _check_reply(reply: Any, n: int) -> str | None:
    if not isinstance(reply, dict) or not isinstance(reply.get("rewards"), list):
        return "the endpoint's reply has no 'rewards' list"
    if len(reply["rewards"]) != n:
        return f"the endpoint returned {len(reply['rewards'])} rewards for {n} items"
    for key in ("infos", "errors"):
        if reply.get(key) is not None and (not isinstance(reply[key], list) or len(reply[key]) != n):
            return f"the endpoint's {key!r} is not a list of {n}"
    return None


def _deliver(p: _Pending, reply: dict[str, Any], i: int) -> None:
    reward = reply["rewards"][i]
    infos, errors = reply.get("infos") or [None] * len(reply["rewards"]), reply.get("errors") or []
    ok = isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward)
    if not ok:
        why = errors[i] if i < len(errors) and errors[i] else f"reward {reward!r} is not a finite number"
        p.fail(f"the endpoint gave item {p.item['id']} no reward: {why}"[:500])
        return
    p.reward, p.info = float(reward), dict(infos[i]) if isinstance(infos[i], dict) else {}
    p.done.set()


_batchers: dict[tuple, _Batcher] = {}
_batchers_lock = threading.Lock()


def batcher(url: str, timeout_s: float, retries: int, batch_size: int, max_wait_s: float,
            headers: dict[str, str], concurrency: int) -> _Batcher:
    """The process's queue for an endpoint and these settings (shared by every environment that uses them)."""
    key = (url, timeout_s, retries, batch_size, max_wait_s, json.dumps(headers, sort_keys=True), concurrency)
    with _batchers_lock:
        if key not in _batchers:
            _batchers[key] = _Batcher(url, timeout_s, retries, batch_size, max_wait_s, headers, concurrency)
        return _batchers[key]


class EndpointEnv(Env):
    """Single-turn: the reward comes from an HTTP endpoint (a reward model, a verifier), batched across episodes."""

    task_type = "endpoint"
    requires_answer = False  # the endpoint decides what it needs of the task

    def __init__(self, tasks: list[Task] | None = None, *, url: str, timeout_s: float = 30.0, retries: int = 2,
                 batch_size: int = 16, max_wait_s: float = 0.02, headers: dict[str, str] | None = None,
                 concurrency: int = 4) -> None:
        super().__init__(tasks)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint url must start with http:// or https://, got {url!r}")
        if timeout_s <= 0 or retries < 0 or batch_size < 1 or max_wait_s < 0 or concurrency < 1:
            raise ValueError("endpoint: timeout_s > 0, retries >= 0, batch_size >= 1, max_wait_s >= 0 and "
                             "concurrency >= 1")
        self.url, self.timeout_s, self.retries, self.max_wait_s = url, timeout_s, retries, max_wait_s
        self.batcher = batcher(url, timeout_s, retries, batch_size, max_wait_s, dict(headers or {}), concurrency)

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        item = {"id": task.id, "prompt": task.prompt, "messages": task.messages, "response": response,
                "answer": task.answer, "meta": task.meta}
        queued = self.batcher.queue.qsize()
        pending = self.batcher.submit(item)
        # the longest a request can take (every attempt timing out, the back-offs between them, the batch's wait),
        # times the requests queued before this one's
        once = (self.retries + 1) * self.timeout_s + BACKOFF_S * (2 ** self.retries) + self.max_wait_s + 5.0
        limit = once * (1 + queued // (self.batcher.batch_size * self.batcher.concurrency))
        if not pending.done.wait(limit):
            raise EndpointError(f"no reward from {self.url} for task {task.id} within {limit:g} s")
        self.diagnostics.update(pending.measured)  # timings and batch sizes: not deterministic, so not in info
        if pending.error is not None:
            raise EndpointError(pending.error)
        return pending.reward, pending.info


register("endpoint", EndpointEnv)
