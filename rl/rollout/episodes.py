"""Environments at run time: one fresh environment per episode, many episodes stepped concurrently.

A slow environment (a sandbox, a critic) must not hold up the others, and an environment that raises
or runs past its entry's ``timeout_s`` costs only its own trajectory: the result carries the error,
the trajectory is left out of the loss and counted in ``env_errors``.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from envs import Env, Task, registry
from rl.config import Config, EnvConfig
from rl.errors import UserError


class _EpisodeTimeout(Exception):
    """An episode ran past its entry's timeout_s (distinct from a TimeoutError the environment raises)."""


@dataclass
class EpisodeResult:
    reward: float
    info: dict[str, Any]
    error: str | None = None  # set when the environment raised or timed out


def solved(result: EpisodeResult, completion, success: float = 1.0) -> bool:
    """Whether a response counts as right: a reward of at least ``success`` (``run.eval_success``) without an
    environment error, and it ended on its own rather than at its token budget."""
    return result.error is None and result.reward >= success and completion.finish_reason == "stop"


def env_class(entry: EnvConfig) -> type[Env]:
    """The environment class of a config entry (a clear error when the name is not registered)."""
    try:
        return registry.get(entry.name)
    except registry.UnknownEnvironmentError as e:
        raise UserError(f"env.name: {e}") from None


def scored_alone(entry: EnvConfig) -> bool:
    """Whether one single-turn response of ``entry`` has a reward of its own (held-out evaluation, pass rates): not
    a multi-turn episode, and not rewards that compare a group's responses (``Env.relative_rewards``)."""
    cls = env_class(entry)
    return not cls.multi_turn and not cls.rewards_relative(entry.kwargs)


def make_env(entry: EnvConfig, cfg: Config) -> Env:
    """A fresh environment of ``entry``; environments that run code get the run's sandbox service address."""
    cls = env_class(entry)
    kwargs = dict(entry.kwargs)
    if cls.uses_sandbox:
        kwargs.setdefault("sandbox_address", sandbox_address(cfg))
    return cls(**kwargs)


_services: dict[str, Any] = {}  # the run's own sandbox services, by their options (one per process and section)
_services_lock = threading.Lock()


def sandbox_address(cfg: Config) -> str:
    """The run's sandbox service: ``sandbox.address``, or one of its own from its ``sandbox`` section (limits,
    backend, concurrency...) in a child process on a free port, started again if it dies, stopped at exit."""
    if cfg.sandbox.address:
        return cfg.sandbox.address
    from rl.rollout.sandbox_service import SandboxServiceProcess

    key = cfg.sandbox.model_dump_json()
    with _services_lock:
        if key not in _services:
            service = _services[key] = SandboxServiceProcess(cfg.sandbox)
            atexit.register(service.stop)
        return _services[key].address


def sandbox_restarts() -> int:
    """Restarts of the run's own sandbox services so far (a dead service is started again)."""
    return sum(s.restarts for s in list(_services.values()))


def run_episode(env: Env, task: Task, text: str) -> tuple[float, dict[str, Any]]:
    """One single-turn episode: reset on the task, step the response."""
    try:
        env.reset(options={"task": task})
        _, reward, _, _, info = env.step(text)
    finally:
        env.close()
    return float(reward), info


Critic = Callable[[list[str]], list[str]]


class EpisodeRunner:
    """Runs episodes on a thread pool; each ``map*`` returns one result per job, in order.

    ``critic`` (prompts -> outputs, usually the policy on the shared inference engine) is attached to every
    environment (``Env.attach``: those that judge with it, such as the rubric environment, take it).
    """

    def __init__(self, cfg: Config, workers: int | None = None, critic: Critic | None = None):
        self.cfg, self.critic = cfg, critic
        self.pool = cf.ThreadPoolExecutor(workers or cfg.rollout.env_workers, thread_name_prefix="env")

    def make_env(self, entry: EnvConfig) -> Env:
        """A fresh environment of ``entry``, with the critic attached where it takes one."""
        env = make_env(entry, self.cfg)
        if self.critic is not None:
            env.attach(self.critic)
        return env

    def map(self, jobs: list[tuple[EnvConfig, Task, str]],
            on_done: Callable[[], None] | None = None) -> list[EpisodeResult]:
        """Score ``(entry, task, response)`` jobs concurrently, each within its entry's ``timeout_s``."""
        def one(entry: EnvConfig, task: Task, text: str) -> tuple[float, dict[str, Any]]:
            return run_episode(self.make_env(entry), task, text)

        outs = self.run_calls([(partial(one, *job), job[0].timeout_s) for job in jobs], on_done)
        return [EpisodeResult(0.0, {}, err) if err else EpisodeResult(*out) for out, err in outs]

    def map_groups(self, jobs: list[tuple[EnvConfig, Task, list[str]]]) -> list[tuple[list[float] | None, str | None]]:
        """Group-level rewards of ``(entry, task, responses)`` jobs: (rewards, None) or (None, error)."""
        def one(entry: EnvConfig, task: Task, texts: list[str]) -> list[float]:
            env = self.make_env(entry)
            try:
                rewards, _ = env.score_group(task, texts)
            finally:
                env.close()
            if len(rewards) != len(texts):
                raise ValueError(f"score_group returned {len(rewards)} rewards for {len(texts)} responses")
            return [float(r) for r in rewards]

        return self.run_calls([(partial(one, *job), job[0].timeout_s) for job in jobs], None)

    def run_calls(self, calls: list[tuple[Callable[[], Any], float]],
             on_done: Callable[[], None] | None = None) -> list[tuple[Any, str | None]]:
        """Run each ``(fn, timeout_s)`` on the pool: (result, None), or (None, error) when it raised or timed out."""
        starts: dict[int, float] = {}

        def timed(i: int, fn: Callable[[], Any]) -> Any:
            starts[i] = time.monotonic()
            return fn()

        futures = [self.pool.submit(timed, i, fn) for i, (fn, _) in enumerate(calls)]
        results: list[tuple[Any, str | None]] = []
        for i, fut in enumerate(futures):
            timeout_s = calls[i][1]
            try:
                results.append((self._wait(fut, lambda i=i: starts.get(i), timeout_s), None))
            except _EpisodeTimeout:
                # The thread cannot be killed; it finishes in the background and its result is ignored.
                results.append((None, f"TimeoutError: the environment took over {timeout_s:g} s"))
            except UserError:
                raise
            except Exception as e:
                results.append((None, f"{type(e).__name__}: {e}"))
            if on_done:
                on_done()
        return results

    @staticmethod
    def _wait(fut: cf.Future, started: Callable[[], float | None], timeout_s: float):
        """The future's result; the timeout counts from when the episode started, not from when it was queued."""
        while not fut.done():
            t0 = started()
            remaining = 0.2 if t0 is None else t0 + timeout_s - time.monotonic()
            if remaining <= 0:
                raise _EpisodeTimeout
            cf.wait([fut], timeout=min(0.2, remaining))
        return fut.result()  # the environment's own exception, if any, propagates from here

    def close(self) -> None:
        """Stop the pool without waiting for timed-out episodes."""
        self.pool.shutdown(wait=False, cancel_futures=True)
