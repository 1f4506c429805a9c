"""Multi-turn episodes in the RL loop: turn-by-turn generation on the real engine, observations as context only
(loss mask 0), and a real run training on them."""

import json
import pickle
import re
from collections import Counter

import pytest
from rich.progress import Progress

from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from envs import Env, Task, register
from rl.config import parse_config
from rl.loop.controller import train
from rl.rollout.data import TaskSets
from rl.rollout.episodes import EpisodeRunner
from rl.rollout.multiturn import Episodes
from rl.rollout.partial import PartialRolloutBuffer
from rl.rollout.phase import run_rollout
from rl.rollout.rewards import settle
from rl.rollout.turns import WorkerContexts, serve_turns
from rl.sample import Sample
from rl.settings import task_types
from rl.setup.warmstart import prepare_model
from tests.test_run import TINY

#: an engine's counters as a rollout worker reports them (none counted here)
COUNTS = {"prefix_hit_tokens": 0, "prefix_miss_tokens": 0, "preemptions": 0, "kv_blocks_peak": 0, "kv_blocks": 1,
          "peak_bytes": 0}


class KeptEpisodes(Episodes):
    """The driver's episodes, each kept once it ends (a run closes and forgets them)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.kept: dict[int, object] = {}

    def close(self, keys: list[int]) -> None:
        self.kept.update({k: self.live[k] for k in keys if k in self.live})
        super().close(keys)


def play_episodes(cluster, cfg, tok, runner, groups, it: int = 0, max_context: int = 128, budget=None):
    """K episodes for each ``(group id, entry, task)`` through the rollout phase, as a run plays them (their turns
    on ``cluster.rollout``) until they end or ``budget`` runs out; returns the groups that ended, settled (samples to
    train on and the reward statistics), and the episodes (driver side, by key; ``.ended``: every sample that
    ended, errors included)."""
    types, k = task_types(cfg), cfg.rollout.samples_per_prompt
    sets = TaskSets([t for _, _, t in groups], [], [e for _, e, _ in groups], list(range(len(groups))))
    buffer = PartialRolloutBuffer(cfg.rollout.partial.max_age)
    for i, (group, _, _) in enumerate(groups):
        kind = types.get(sets.type_of(i))
        buffer.add_group([Sample(key, group, i, kind, [], SamplingParams(kind.temperature.at(it), kind.max_tokens), it,
                                 loss_mask=[], multi_turn=True) for key in range(group * k, group * k + k)])
    episodes = KeptEpisodes(runner, tok, cfg.model.tool_format, cfg.rollout.max_turns, max_context, cfg.run.seed)
    with Progress(disable=True) as progress:
        run_rollout(cluster, buffer, episodes, sets, it, budget, progress)
    episodes.ended = [s for g in buffer.pop_complete() for s in g]
    samples, stats = settle(list(episodes.ended), sets, types, episodes.take_template_errors())
    return samples, stats, episodes

NUDGE = " No. Another digit:"


class GuessDigit(Env):
    """Guess the hidden digit; each wrong guess gets the nudge as the next observation."""

    task_type = "guess"
    multi_turn = True

    def step(self, action):
        m = re.search(r"\d", action)
        if m and m.group() == self.task.answer:
            return "", 1.0, True, False, {}
        return NUDGE, 0.0, False, False, {}

    @classmethod
    def generate_tasks(cls, n, seed):
        return [Task(f"g-{seed}-{i}", f"Guess the digit of puzzle {seed}-{i}:", str((seed + i) % 10))
                for i in range(n)]


register("guess-test", GuessDigit)


class EngineOnly:
    """The one call the rollout phase makes of the cluster, as ``Cluster.rollout`` makes it of one rollout worker
    (``rl.rollout.turns``), on a real in-process inference engine: requests and results cross by pickle, as Ray
    carries them. Keeps the prompts the engine was given per call and the tokens that crossed each way, per key."""

    def __init__(self, engine):
        self.engine, self.calls, self.held = engine, [], {}
        self.sent, self.returned = Counter(), Counter()
        add = engine.add_request

        def spy(prompt_ids, params, **kw):
            self.calls[-1].append(list(prompt_ids))
            return add(prompt_ids, params, **kw)

        engine.add_request = spy

    def rollout(self, samples, token_budget, on_worker=None, contexts=None):
        contexts = WorkerContexts() if contexts is None else contexts
        self.calls.append([])
        asked = contexts.requests(0, self, samples)
        for r in asked:
            self.sent[r.key] += len(r.tokens) + len(r.logprobs)
        results, missing = serve_turns(self.engine, self.held, pickle.loads(pickle.dumps(asked)), token_budget, 0)
        assert missing == []
        contexts.received(0, self, asked, results)
        for r in results:
            self.returned[r.key] += len(r.token_ids) + len(r.logprobs)
        return pickle.loads(pickle.dumps(results)), [COUNTS]


def test_turns_append_observations_as_masked_context(tiny_model, tokenizer):
    cfg = parse_config({"env": {"name": "guess-test"}, "rollout": {"samples_per_prompt": 3, "max_turns": 4,
                                                                    "max_tokens": 3}})
    cluster = EngineOnly(InferenceEngine(tiny_model.eval(), tokenizer.eos_id, tokenizer.pad_id))
    tasks = GuessDigit.generate_tasks(2, seed=0)
    runner = EpisodeRunner(cfg)
    try:
        samples, stats, _ = play_episodes(cluster, cfg, tokenizer, runner, [(7, cfg.env, tasks[0]),
                                                                            (8, cfg.env, tasks[1])])
    finally:
        runner.close()
    assert stats["multi_turn_episodes"] == 6 and stats["multi_turn_errors"] == 0 and len(samples) == 6
    nudge = tokenizer.encode(NUDGE)
    for s in samples:
        assert len(s.response_ids) == len(s.logprobs) == len(s.loss_mask)
        # the response alternates model turns (mask 1) and nudges (mask 0) that are exactly the observation tokens
        spans, i = [], 0
        while i < len(s.loss_mask):
            j = i
            while j < len(s.loss_mask) and s.loss_mask[j] == s.loss_mask[i]:
                j += 1
            spans.append((int(s.loss_mask[i]), s.response_ids[i:j].tolist(), s.logprobs[i:j].tolist()))
            i = j
        for m, ids, lps in spans:
            if m == 0:
                assert ids == nudge and lps == [0.0] * len(nudge)
            else:
                assert all(lp <= 0 for lp in lps)
        model_turns = [ids for m, ids, _ in spans if m == 1]
        answer = tasks[s.group - 7].answer
        guess = re.search(r"\d", tokenizer.decode(model_turns[-1]))
        if s.reward == 1.0:  # solved on its last turn
            assert guess and guess.group() == answer
        else:  # out of turns: every guess was wrong
            assert s.reward == 0.0 and len(model_turns) == 4
        # each turn was generated from the first prompt plus everything before it
        sent = {tuple(p) for call in cluster.calls for p in call}
        starts = [i for i in range(len(s.loss_mask)) if s.loss_mask[i] == 1 and (i == 0 or s.loss_mask[i - 1] == 0)]
        assert all(tuple(s.prompt_ids.tolist() + s.response_ids[:i].tolist()) in sent for i in starts)
        # what crossed to the worker: its first prompt and the observations, once; back: its own tokens, once
        assert cluster.sent[s.key] == len(s.prompt_ids) + len(s.response_ids) - s.own_tokens()
        assert cluster.returned[s.key] == 2 * s.own_tokens()  # tokens and their log-probs
    assert any(s.reward == 0.0 for s in samples) and len(cluster.calls) == 4


class Chatter(Env):
    """Never solved: every turn is answered with the same observation, until the turns or the context run out."""

    task_type = "chat"
    multi_turn = True

    def step(self, action):
        return " No.", 0.0, False, False, {}

    @classmethod
    def generate_tasks(cls, n, seed):
        return [Task(f"c-{seed}-{i}", f"Say something {i}:", "") for i in range(n)]


register("chatter-test", Chatter)


@pytest.mark.parametrize("turns", [3, 9])
def test_an_episode_moves_each_token_to_the_worker_and_back_once(tiny_model, tokenizer, turns):
    """An n-turn episode's rounds carry only what is new: O(n) tokens in all (its context once), where sending
    each turn's whole context, and taking the whole history back, as the list-based rollout did, is O(n²)."""
    cfg = parse_config({"env": {"name": "chatter-test"}, "rollout": {"samples_per_prompt": 2, "max_turns": turns,
                                                                      "max_tokens": 3}})
    cluster = EngineOnly(InferenceEngine(tiny_model.eval(), tokenizer.eos_id, tokenizer.pad_id))
    runner = EpisodeRunner(cfg)
    try:
        samples, _, _ = play_episodes(cluster, cfg, tokenizer, runner, [(g, cfg.env, t) for g, t in
                                                                        enumerate(Chatter.generate_tasks(2, 0))])
    finally:
        runner.close()
    assert len(samples) == 4 and all(s.turns == turns and s.status == "truncated" for s in samples)
    # every round's prompt was the episode's whole context so far (the worker rebuilt it from what it kept)
    prompts = {tuple(p) for call in cluster.calls for p in call}
    for s in samples:
        starts = [i for i in range(len(s.loss_mask)) if s.loss_mask[i] and (i == 0 or not s.loss_mask[i - 1])]
        assert len(starts) == turns
        assert all(tuple(s.prompt_ids.tolist() + s.response_ids[:i].tolist()) in prompts for i in starts)
    context = sum(s.context_len for s in samples)
    moved = sum(cluster.sent.values()) + sum(cluster.returned.values())
    own = sum(s.own_tokens() for s in samples)
    assert moved == context + own  # each context token crossed once (a model token back, with its log-prob)
    # the list-based rounds: each turn's whole context there, the whole history back (tokens and log-probs)
    before = sum(len(s.prompt_ids) + i + 2 * len(s.response_ids[:j])
                 for s in samples for i, j in zip(starts_of(s), [*starts_of(s)[1:], len(s.response_ids)],
                                                   strict=True))
    assert before > (turns / 3) * moved


def starts_of(s):
    """Where each model turn of ``s`` begins in its response."""
    return [i for i in range(len(s.loss_mask)) if s.loss_mask[i] and (i == 0 or not s.loss_mask[i - 1])]


def test_a_run_trains_on_multi_turn_episodes(ray_cluster, tmp_path, monkeypatch):
    # what crosses to the rollout workers (built on the driver) and back, per sample key; the samples that ended
    sent, returned, ended = Counter(), Counter(), []
    requests, received, pop = WorkerContexts.requests, WorkerContexts.received, PartialRolloutBuffer.pop_complete

    def count_requests(self, *args):
        out = requests(self, *args)
        sent.update({r.key: len(r.tokens) + len(r.logprobs) for r in out})
        return out

    def count_results(self, worker, actor, asked, results):
        returned.update({r.key: len(r.token_ids) + len(r.logprobs) for r in results})
        return received(self, worker, actor, asked, results)

    monkeypatch.setattr(WorkerContexts, "requests", count_requests)
    monkeypatch.setattr(WorkerContexts, "received", count_results)
    monkeypatch.setattr(PartialRolloutBuffer, "pop_complete", lambda self: ended.extend(g := pop(self)) or g)
    model = prepare_model(parse_config(TINY))
    raw = json.loads(json.dumps(TINY))
    raw.update({"model": {"path": str(model)}, "run": {"iterations": 1, "eval_every": 1, "save_every": 1}})
    raw["env"] = {"name": "guess-test", "num_train": 50, "num_eval": 8}
    raw["envs"] = [{"name": "arithmetic", "num_train": 50, "num_eval": 8},
                   {"name": "guess-test", "num_train": 50, "num_eval": 8, "weight": 3}]
    raw["rollout"].update({"max_turns": 3, "task_types": {"guess": {"max_tokens": 4}}})
    raw.setdefault("algorithm", {})["drop_equal_reward_groups"] = False  # a tiny model's rewards may all be 0
    summary = train(parse_config(raw), tmp_path / "run")
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["multi_turn_episodes"] > 0 and rec["multi_turn_errors"] == 0 and rec["env_errors"] == 0
    assert 1 <= rec["multi_turn_turns"] <= 3
    assert rec["trained_samples"] == rec["multi_turn_episodes"] + 4 * (4 - rec["multi_turn_episodes"] // 4)
    assert rec["optimizer_steps"] > 0 and summary["iterations"] == 1
    # through the real cluster: each sample's context crossed to its worker once, each generated token came back once
    samples = [s for g in ended for s in g]
    assert any(s.multi_turn and s.turns > 1 for s in samples) and any(not s.multi_turn for s in samples)
    assert sent == {s.key: s.context_len - s.own_tokens() for s in samples}
    assert returned == {s.key: 2 * s.own_tokens() for s in samples}
