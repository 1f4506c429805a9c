"""One thread that owns a rollout engine and steps it while requests are pending, for a server's many callers.

Callers on any thread ``submit`` requests (joining the running batch: continuous batching) and get two futures:
``accepted`` (the request id, or the InvalidRequestError that refused it) and ``done`` (its ``Completion``). A
request submitted with ``on_tokens`` is watched: after every step that gave it new tokens, ``on_tokens(progress)`` is
called on the loop's thread with what it generated since the last call (a ``Progress``: what a server streams; only
the new tokens, so a long stream costs the same per step).
``call`` runs a function on the loop's thread between steps, so the model is never used by two threads at once.
A step that fails fails the requests then in flight, not the loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.inference.base import RolloutEngine
from engines.inference.requests import Progress
from engines.inference.sampling import InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)

OnTokens = Callable[[Progress], None]


@dataclass
class Submitted:
    """A request handed to the loop: its futures, and how much of it ``on_tokens`` has been told."""

    prompt: list[int]
    params: SamplingParams
    on_tokens: OnTokens | None = None
    images: tuple = ()  # the prompt's images (a vision-language model's)
    accepted: Future = field(default_factory=Future)
    done: Future = field(default_factory=Future)
    told: int = 0


class EngineLoop:
    """Owns ``engine`` on a thread of its own; ``submit`` and ``call`` are safe from any thread."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._running: dict[int, Submitted] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, on_tokens: OnTokens | None = None,
               images: tuple = ()) -> Submitted:
        """Queue a request (``images``: its prompt's); its ``accepted`` and ``done`` futures resolve on the loop's
        thread."""
        job = Submitted(prompt, params, on_tokens, tuple(images))
        self._inbox.put(job)
        return job

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the engine's thread between steps."""
        fut: Future = Future()
        self._inbox.put((fn, fut))
        return fut

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _take(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            if isinstance(item, tuple):  # a function to run here
                fn, fut = item
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)
                continue
            try:
                rid = self.engine.add_request(item.prompt, item.params, images=item.images)
            except InvalidRequestError as e:
                item.accepted.set_exception(e)
                item.done.set_exception(e)
                continue
            self._running[rid] = item
            item.accepted.set_result(rid)

    def _run(self) -> None:
        # a new thread's current CUDA device is the first one, not necessarily the engine's
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)
        while not self._stop.is_set():
            self._take(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                continue
            try:
                done = self.engine.step()
            except Exception as e:  # a failing step fails its requests, not the server
                log.warning("engine step failed (%s); failing the requests in flight", e)
                for c in self.engine.pause():
                    self._running.pop(c.request_id).done.set_exception(e)
                continue
            for c in done:
                self._running.pop(c.request_id).done.set_result(c)
            self._tell()

    def _tell(self) -> None:
        """Give each watched request's ``on_tokens`` what it generated since it was last told."""
        watched = {rid: job.told for rid, job in self._running.items() if job.on_tokens is not None}
        if not watched:
            return
        for rid, progress in self.engine.progress(watched).items():
            job = self._running[rid]
            if progress.tokens:
                job.told += len(progress.tokens)
                try:
                    job.on_tokens(progress)
                except Exception as e:  # a caller's callback must not stop the loop
                    log.warning("on_tokens of request %d failed: %s", rid, e)
