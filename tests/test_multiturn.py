"""Multi-turn episodes in the RL loop: turn-by-turn generation on the real engine, observations as context only
(loss mask 0), and a real run training on them."""

import json
import re

from rich.progress import Progress

from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from envs import Env, Task, register
from rl.config import parse_config
from rl.loop.controller import train
from rl.rollout.data import TaskSets
from rl.rollout.episodes import EpisodeRunner
from rl.rollout.multiturn import Episodes
from rl.rollout.partial import PartialRolloutBuffer, advance
from rl.rollout.phase import run_rollout
from rl.rollout.rewards import settle
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
    """The one call the rollout phase makes of the cluster, on a real in-process inference engine."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def rollout(self, samples, token_budget, on_worker=None):
        self.calls.append([s.request().prompt_ids for s in samples])
        return advance(self.engine, samples, token_budget, 0), [COUNTS]


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
            spans.append((s.loss_mask[i], s.response_ids[i:j], s.logprobs[i:j]))
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
        assert all(tuple(s.prompt_ids + s.response_ids[:i]) in sent for i in starts)
    assert any(s.reward == 0.0 for s in samples) and len(cluster.calls) == 4


def test_a_run_trains_on_multi_turn_episodes(ray_cluster, tmp_path):
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
