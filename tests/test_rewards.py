"""Rewards come from the environments (a task mix, stepped concurrently); budget control per task type; raising
or hanging environments cost only their own trajectory."""

import threading

from engines.inference.sampling import SamplingParams
from envs import Env, Task, register
from envs.arithmetic import ArithmeticEnv
from rl.algo.schedules import Schedule
from rl.config import parse_config
from rl.rollout.data import TaskSets, sample_mix, sample_prompts
from rl.rollout.episodes import EpisodeRunner
from rl.rollout.rewards import score as score_groups
from rl.rollout.rewards import settle
from rl.sample import Sample, TaskType
from rl.settings import task_types

STATUS = {"stop": "finished", "length": "truncated", "error": "error"}
UNTYPED = TaskType("?", 40, 0.0, Schedule("constant", 1.0, 1.0, 1))


def score(groups, sets, tok, cfg, runner=None):
    """The reward phase on ``groups``: each sample typed as the draw types it, scored, settled."""
    types = task_types(cfg)
    for s in (s for g in groups for s in g):
        s.task_type = types.get(sets.type_of(s.task_index))
    own = runner is None
    runner = runner or EpisodeRunner(cfg)
    try:
        score_groups(groups, sets, tok, runner)
    finally:
        if own:
            runner.close()
    return settle([s for g in groups for s in g], sets, types)


class Flaky(Env):
    """A user environment that raises on some tasks."""

    def score(self, task, response):
        if task.id.endswith("-1"):
            raise RuntimeError("grader crashed")
        return ArithmeticEnv().score(task, response)


register("flaky-test", Flaky)


def single(tasks, cfg) -> TaskSets:
    """Training tasks of the config's single environment."""
    return TaskSets(tasks, [], cfg.env_entries, [0] * len(tasks))


def _traj(tok, key, group, task_index, text, reason="stop", temperature=1.0):
    ids = tok.encode(text)
    return Sample(key=key, group=group, task_index=task_index, task_type=UNTYPED, prompt_ids=[1, 2],
                  params=SamplingParams(temperature, 40), started=0, response_ids=ids, logprobs=[-0.5] * len(ids),
                  segments=[(0, 0)], status=STATUS[reason])


def test_reward_truncation_and_errors(tokenizer):
    tasks = ArithmeticEnv.generate_tasks(2, seed=0)
    cfg = parse_config({"env": {"name": "flaky-test"},
                        "rollout": {"samples_per_prompt": 2, "truncation_penalty": -0.5}})
    groups = [
        [_traj(tokenizer, 0, 7, 0, tasks[0].meta["solution"], temperature=0.8),    # right
         _traj(tokenizer, 1, 7, 0, tasks[0].meta["solution"], "length")],           # right but out of budget
        [_traj(tokenizer, 2, 9, 1, tasks[1].meta["solution"]),                      # grader raises
         _traj(tokenizer, 3, 9, 1, " The answer is 0.")],                           # grader raises
    ]
    samples, stats = score(groups, single(tasks, cfg), tokenizer, cfg)
    assert [(s.group, s.reward, s.temperature) for s in samples] == [(7, 1.0, 0.8), (7, -0.5, 1.0)]
    assert stats["env_errors"] == 2 and "grader crashed" in stats["first_env_error"]
    assert stats["truncation_rate"] == 0.25


def test_budget_and_penalty_per_task_type(tokenizer):
    """Each task type has its own token budget and truncation penalty, and its own truncation rate."""
    base = ArithmeticEnv.generate_tasks(3, seed=1)
    tasks = [Task(t.id, t.prompt, t.answer, {**t.meta, "task_type": tt})
             for t, tt in zip(base, ["short", "long", "long"], strict=True)]
    cfg = parse_config({"rollout": {"max_tokens": 30, "truncation_penalty": 0.0,
                                    "task_types": {"short": {"max_tokens": 8, "truncation_penalty": -1.0},
                                                   "long": {"temperature": {"schedule": "linear", "start": 1.2,
                                                                            "end": 0.6}}}}})
    types = task_types(cfg)
    assert (types.get("short").max_tokens, types.get("short").truncation_penalty) == (8, -1.0)
    long = types.get("long")
    assert (long.max_tokens, long.truncation_penalty) == (30, 0.0) and long.temperature.start == 1.2
    assert (types.get("other").max_tokens, types.get("other").truncation_penalty) == (30, 0.0)
    groups = [[_traj(tokenizer, 0, 0, 0, "12+", "length"), _traj(tokenizer, 1, 0, 0, base[0].meta["solution"])],
              [_traj(tokenizer, 2, 1, 1, "1", "length"), _traj(tokenizer, 3, 1, 1, base[1].meta["solution"])],
              [_traj(tokenizer, 4, 2, 2, base[2].meta["solution"]), _traj(tokenizer, 5, 2, 2, "x")]]
    samples, stats = score(groups, single(tasks, cfg), tokenizer, cfg)
    assert [s.reward for s in samples] == [-1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert stats["truncation_rate/short"] == 0.5 and stats["truncation_rate/long"] == 0.25
    assert stats["truncation_rate"] == 2 / 6
    assert stats["reward_mean/short"] == 0.0 and stats["reward_mean/long"] == 0.5


class Slow(Env):
    """Answers only once three episodes are inside ``score`` at the same time (so it needs concurrency), and hangs
    on tasks whose id ends in -2."""

    barrier = threading.Barrier(3)
    task_type = "slow"

    def score(self, task, response):
        if task.id.endswith("-2"):
            threading.Event().wait(5)
        Slow.barrier.wait(timeout=20)
        return 0.5, {}


register("slow-test", Slow)


def test_task_mix_routes_each_task_to_its_environment_concurrently(tokenizer):
    cfg = parse_config({"envs": [{"name": "arithmetic", "num_train": 50, "num_eval": 10},
                                 {"name": "slow-test", "weight": 3, "timeout_s": 1.0, "num_train": 50,
                                  "num_eval": 10, "kwargs": {}}],
                        "rollout": {"samples_per_prompt": 2, "env_workers": 8}})
    arith = ArithmeticEnv.generate_tasks(3, seed=0)
    slow = [Task(f"s-{i}", f"prompt {i}", "") for i in range(3)]
    sets = TaskSets(arith + slow, [], cfg.env_entries, [0, 0, 0, 1, 1, 1])
    groups = [[_traj(tokenizer, 0, 0, 0, arith[0].meta["solution"]), _traj(tokenizer, 1, 0, 0, "no")],
              [_traj(tokenizer, 2, 1, 3, "a"), _traj(tokenizer, 3, 1, 3, "b")],
              [_traj(tokenizer, 4, 2, 4, "c"), _traj(tokenizer, 5, 2, 5, "hangs")]]
    samples, stats = score(groups, sets, tokenizer, cfg)
    assert [(s.group, s.reward) for s in samples] == [(0, 1.0), (0, 0.0), (1, 0.5), (1, 0.5), (2, 0.5)]
    assert stats["env_errors"] == 1 and "took over 1 s" in stats["first_env_error"]
    assert stats["reward_mean/slow"] == 0.5 * 3 / 4 and stats["reward_mean/arithmetic"] == 0.5


def test_mix_sampling_follows_the_weights():
    cfg = parse_config({"envs": [{"name": "arithmetic", "weight": 1}, {"name": "arithmetic", "weight": 3,
                                                                       "task_type": "b"}]})
    sets = TaskSets([Task(str(i), "", "") for i in range(2000)], [], cfg.env_entries, [0] * 1000 + [1] * 1000)
    picks = [i for it in range(20) for i in sample_mix(sets, 64, seed=0, iteration=it)]
    share = sum(i >= 1000 for i in picks) / len(picks)
    assert 0.7 < share < 0.8 and len(set(sample_mix(sets, 64, 0, 5))) == 64
    assert sample_mix(sets, 64, 0, 5) == sample_mix(sets, 64, 0, 5)
    one = TaskSets(sets.train, [], cfg.env_entries[:1], [0] * 2000)
    assert sample_mix(one, 64, 0, 5) == sample_prompts(2000, 64, 0, 5)  # single env: the demo's draw, unchanged


def test_group_level_environment_gets_all_k_responses_and_the_critic(tokenizer):
    """A rubric task's K responses are judged together by the critic (here a stand-in that prefers the longer
    response), so the longest response gets the highest reward; verifiable tasks in the same batch are untouched."""
    from envs.rubric import parse_verdict

    def longer(prompts: list[str]) -> list[str]:
        outs = []
        for p in prompts:
            a = p.split("## Response A\n")[1].split("\n\n## Response B")[0]
            b = p.split("## Response B\n")[1].split("\n\n## Your task")[0]
            outs.append("Verdict: A" if len(a) > len(b) else "Verdict: B")
        return outs

    cfg = parse_config({"envs": [{"name": "arithmetic"}, {"name": "rubric", "kwargs": {"rubrics": ["core"]}}],
                        "rollout": {"samples_per_prompt": 3}})
    arith = ArithmeticEnv.generate_tasks(1, seed=0)
    sets = TaskSets([*arith, Task("r-0", "Tell me about rivers.", "")], [], cfg.env_entries, [0, 1])
    groups = [[_traj(tokenizer, 0, 0, 0, arith[0].meta["solution"]), _traj(tokenizer, 1, 0, 0, "x"),
               _traj(tokenizer, 2, 0, 0, "y")],
              [_traj(tokenizer, 3, 1, 1, "Rivers flow to the sea and carry water"), _traj(tokenizer, 4, 1, 1, "Rivers"),
               _traj(tokenizer, 5, 1, 1, "Rivers flow")]]
    runner = EpisodeRunner(cfg, critic=longer)
    try:
        samples, stats = score(groups, sets, tokenizer, cfg, runner)
    finally:
        runner.close()
    assert parse_verdict("Verdict: A") == "A"
    assert stats["env_errors"] == 0
    assert [s.reward for s in samples[:3]] == [1.0, 0.0, 0.0]
    r = [s.reward for s in samples[3:]]
    assert r[0] > r[2] > r[1]
