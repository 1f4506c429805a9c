"""Multi-turn episodes in the RL loop: generate a turn, step the environment, append its observation, repeat.

The rollout phase plays the episodes (``play_episodes``); the reward phase turns them into training
samples (``episode_samples``). All active episodes of the iteration generate their next turn in one
batch on the inference engines;
the environments then step concurrently (a sandbox command, a tool call) within their entry's
``timeout_s``. The trained sequence is the whole conversation after the first prompt: the model's
tokens (loss mask 1, with the sampler's log-probs) and the environment's observations (loss mask 0,
context only). An environment that gives its conversation as chat messages (``info["messages"]``, e.g. the
tool-using SWE environment) is rendered with the tokenizer's own chat template (``engines.model.conversation``:
observations are the template's text between the model's turns) and parses calls in the model family's
format (``model.tool_format``, detected from the template); a turn the template cannot render ends the
episode there as truncated. An episode ends when the environment says so, after ``rollout.max_turns`` turns
(truncated: its task type's truncation penalty), or when the conversation no longer fits the model's
context; an environment error drops that trajectory and is counted. Multi-turn groups are not paused
by partial rollout: they finish within their iteration.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from engines.inference.sampling import SamplingParams
from engines.model.chat_format import ChatFormatError, ToolFormat, detect_format
from engines.model.conversation import Conversation
from engines.model.tokenizer import TextTokenizer
from envs import Env, Task
from rl.algo.update import Sample
from rl.config import Config, EnvConfig
from rl.errors import UserError
from rl.rollout.episodes import EpisodeRunner, task_type_of
from rl.seeds import turn_seed


@dataclass
class Episode:
    group: int
    key: int
    entry: EnvConfig
    task: Task
    env: Env
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    temperature: float = 1.0
    turns: int = 0
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    error: str | None = None
    conv: Conversation | None = None  # set when the environment gives chat messages (rendered by the template)
    template_error: str | None = None


def _reset(env: Env, task: Task, fmt: ToolFormat | None) -> tuple[str, dict]:
    if fmt is not None and hasattr(env, "tool_format"):
        env.tool_format = fmt
    return env.reset(options={"task": task})


def _start(e: Episode, tok: TextTokenizer, obs: str, info: dict, fmt: ToolFormat | None) -> list[int]:
    """The first prompt's ids; a chat-message environment's conversation starts here."""
    if info.get("messages") and tok.has_chat_template:
        e.conv = Conversation(tok, info["messages"], info.get("tools"), fmt)
        return e.conv.prompt_ids
    return tok.prompt_ids(e.task) if e.task.messages else tok.encode(obs)


def play_episodes(cluster, cfg: Config, tok: TextTokenizer, runner: EpisodeRunner,
                  groups: list[tuple[int, EnvConfig, Task]], temperatures: dict[str, float], seed: int,
                  max_context: int) -> list[Episode]:
    """Play K episodes for each ``(group id, entry, task)`` to their end; each keeps its environment's final
    reward (or its error)."""
    k = cfg.rollout.samples_per_prompt
    episodes: list[Episode] = []
    for group, entry, task in groups:
        for j in range(k):
            episodes.append(Episode(group, group * k + j, entry, task, runner.make_env(entry), []))
    fmt = None
    if any(hasattr(e.env, "tool_format") for e in episodes):
        try:
            fmt = detect_format(tok, cfg.model.tool_format)
        except ChatFormatError as err:
            raise UserError(f"model.tool_format: {err}") from None
    firsts = runner.run_calls([(lambda e=e: _reset(e.env, e.task, fmt), e.entry.timeout_s) for e in episodes])
    for e, (out, err) in zip(episodes, firsts, strict=True):
        e.prompt_ids = _start(e, tok, *out, fmt) if err is None else []
        e.error, e.done = err, err is not None
    for turn in range(cfg.rollout.max_turns):
        active = [e for e in episodes if not e.done]
        if not active:
            break
        params = []
        for e in active:
            ttype = task_type_of(e.task, e.entry)
            e.temperature = temperatures[ttype]
            budget = min(cfg.task_type(ttype)[0], max_context - len(e.prompt_ids) - len(e.response_ids))
            params.append(SamplingParams(e.temperature, max(budget, 1),
                                         seed=turn_seed(seed, e.key, turn)))
        outs = cluster.generate([e.prompt_ids + e.response_ids for e in active], params, seed=seed)
        steps = runner.run_calls([(lambda e=e, c=c: e.env.step(tok.decode(c.token_ids)), e.entry.timeout_s)
                                  for e, c in zip(active, outs, strict=True)])
        for e, c, (result, err) in zip(active, outs, steps, strict=True):
            e.turns += 1
            if c.finish_reason == "error":
                e.error, e.done = f"the inference engine refused the request: {c.error}", True
                continue
            e.response_ids += c.token_ids
            e.logprobs += c.logprobs
            e.loss_mask += [1] * len(c.token_ids)
            if err is not None:
                e.error, e.done = err, True
                continue
            obs, reward, terminated, truncated, info = result
            if terminated or truncated:
                e.reward, e.done, e.truncated = float(reward), True, bool(truncated)
                if e.conv is not None:
                    e.conv.finish(c.token_ids, (info or {}).get("calls"))
                continue
            if e.conv is not None:
                try:
                    obs_ids = e.conv.add_turn(c.token_ids, (info or {}).get("messages")
                                              or [{"role": "user", "content": obs}], (info or {}).get("calls"))
                except ChatFormatError as err:  # the template cannot go on: the episode ends at this turn
                    e.done, e.truncated, e.template_error = True, True, str(err)
                    continue
            else:
                obs_ids = tok.encode(obs)
            if len(e.prompt_ids) + len(e.response_ids) + len(obs_ids) + 1 >= max_context:
                e.done, e.truncated = True, True  # no room for another turn
                continue
            e.response_ids += obs_ids
            e.logprobs += [0.0] * len(obs_ids)
            e.loss_mask += [0] * len(obs_ids)
    for e in episodes:
        if not e.done:
            e.done, e.truncated = True, True  # out of turns
    runner.run_calls([(e.env.close, 10.0) for e in episodes])
    return episodes


def episode_samples(episodes: list[Episode], cfg: Config) -> tuple[list[Sample], dict[str, Any]]:
    """Training samples of finished episodes (truncated ones take their task type's penalty) and stats."""
    samples, errors, first_error = [], 0, None
    reward_sum: Counter[str] = Counter()
    n_type: Counter[str] = Counter()
    for e in episodes:
        ttype = task_type_of(e.task, e.entry)
        n_type[ttype] += 1
        if e.error or not e.loss_mask:
            errors += 1
            first_error = first_error or f"task {e.task.id}: {e.error or 'no tokens generated'}"
            continue
        reward = cfg.task_type(ttype)[1] if e.truncated else e.reward
        reward_sum[ttype] += reward
        samples.append(Sample(e.group, e.prompt_ids, e.response_ids, e.logprobs, reward,
                              temperature=e.temperature, loss_mask=e.loss_mask))
    stats: dict[str, Any] = {"multi_turn_episodes": len(episodes), "multi_turn_errors": errors,
                             "multi_turn_turns": sum(e.turns for e in episodes) / max(1, len(episodes)),
                             "multi_turn_truncated": sum(e.truncated for e in episodes),
                             "multi_turn_template_errors": sum(e.template_error is not None for e in episodes)}
    for ttype, count in n_type.items():
        stats[f"reward_mean/{ttype}"] = reward_sum[ttype] / count
    if first_error:
        stats["first_multi_turn_error"] = first_error
    return samples, stats
