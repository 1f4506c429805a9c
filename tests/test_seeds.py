"""Every random stream of a run is seeded by rl.seeds: no two streams share a seed, each is deterministic
and moves with the iteration, and each caller draws from its own stream."""

import ast
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.progress import Progress

import rl.loop.controller
import rl.loop.recovery
import rl.loop.rollout_manager
import rl.loop.stream
from envs import Env, Task, register
from envs.arithmetic import ArithmeticEnv
from rl import seeds
from rl.config import parse_config
from rl.loop.controller import Run, iteration
from rl.loop.rollout_manager import RolloutManager
from rl.loop.stop import StopWatch
from rl.rollout.data import TaskSets, sample_mix, sample_prompts
from rl.rollout.multiturn import Episodes
from rl.rollout.partial import PartialRolloutBuffer
from rl.rollout.phase import draw_groups
from rl.rollout.ptx import PtxSample, ptx_batches
from rl.rollout.rewards import episode_runner
from rl.sample import TurnResult
from rl.settings import resolve, task_types
from tests.conftest import make_sample, tiny_config
from tests.test_multiturn import COUNTS, play_episodes


def run_settings(cfg):
    """The run's settings for ``cfg`` on a tiny model (no model directory is read)."""
    return resolve(cfg, tiny_config(64), "unused", 64)

ROOT = Path(__file__).resolve().parents[1]
RUN_SEEDS = [*range(-2, 12), 1_000_003, 2**31 - 1, 2**40 + 7]
ITERATIONS = range(25)
INDICES = range(12)

# stream name -> its seeds over many run seeds, iterations and indices
ITERATION_STREAMS = {
    "prompt": seeds.prompt_seed, "episode": seeds.episode_seed, "critic": seeds.critic_seed,
    "critic_training": seeds.critic_training_seed, "train": seeds.train_seed, "ptx": seeds.ptx_seed,
}


def all_streams() -> dict[str, list[int]]:
    out = {name: [f(s, it) for s in RUN_SEEDS for it in ITERATIONS] for name, f in ITERATION_STREAMS.items()}
    out["sampling"] = [seeds.sampling_seed(s, it, k) for s in RUN_SEEDS for it in ITERATIONS for k in INDICES]
    out["turn"] = [seeds.turn_seed(e, k, t) for e in out["episode"][:60] for k in INDICES for t in range(4)]
    out["chunk"] = [seeds.chunk_seed(c, i) for c in [*out["critic"][:60], 0, 1, 2] for i in INDICES]
    out["eval"] = [seeds.eval_seed(p, j) for p in range(200) for j in range(8)]
    out["warmstart"] = [seeds.warmstart_seed(s) for s in RUN_SEEDS]
    out["difficulty"] = [seeds.difficulty_seed(s, b) for s in RUN_SEEDS for b in range(-1, 30)]
    out["task_set"] = [seeds.task_set_seed(split) for split in ("train", "eval", "sft")]
    return out


def test_no_two_streams_ever_share_a_seed():
    streams = all_streams()
    owner: dict[int, str] = {}
    for name, values in streams.items():
        assert len(set(values)) == len(values), f"stream {name} repeats a seed across its coordinates"
        for v in values:
            assert v not in owner, f"streams {owner[v]} and {name} share seed {v}"
            owner[v] = name
            assert 0 <= v < 2**63  # SamplingParams.seed's range; torch.manual_seed and random.Random take it too


def test_streams_are_deterministic_and_move_with_the_iteration():
    for f in ITERATION_STREAMS.values():
        for s in RUN_SEEDS:
            assert f(s, 3) == f(s, 3)
            assert len({f(s, it) for it in ITERATIONS}) == len(ITERATIONS)
        assert f(0, 5) != f(1, 5)  # and with the run seed
    assert seeds.sampling_seed(0, 1, 2) != seeds.sampling_seed(0, 2, 2) != seeds.sampling_seed(0, 2, 3)


def test_seeds_do_not_depend_on_the_python_process():
    """A stable hash, not Python's salted hash(): a resume in a new process draws what the first process drew."""
    code = "from rl import seeds; print(seeds.prompt_seed(7, 3), seeds.sampling_seed(7, 3, 11))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(seeds.prompt_seed(7, 3)), str(seeds.sampling_seed(7, 3, 11))]


# --- each caller draws from its own stream ---------------------------------------------------------------


def test_prompt_draw_uses_prompt_seed():
    for s, it in [(0, 0), (3, 7), (-1, 12)]:
        assert sample_prompts(500, 16, s, it) == random.Random(seeds.prompt_seed(s, it)).sample(range(500), 16)
    cfg = parse_config({"envs": [{"name": "arithmetic", "weight": 1}, {"name": "arithmetic", "weight": 2}]})
    sets = TaskSets([Task(str(i), "", "") for i in range(100)], [], cfg.env_entries, [0] * 50 + [1] * 50)
    rng = random.Random(seeds.prompt_seed(4, 9))
    picks = rng.choices(range(2), weights=[1, 2], k=10)
    expected = rng.sample(range(50), picks.count(0)) + rng.sample(range(50, 100), picks.count(1))
    assert sample_mix(sets, 10, 4, 9) == expected


class Tok:
    eos_id = 0

    def prompt_ids(self, task):
        return [1, 2]

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_new_rollout_groups_use_the_prompt_and_sampling_seeds():
    cfg = parse_config({"run": {"seed": 5}, "rollout": {"prompts_per_iteration": 3, "samples_per_prompt": 2}})
    tasks = ArithmeticEnv.generate_tasks(40, seed=0)
    sets = TaskSets(tasks, [], cfg.env_entries, [0] * len(tasks))
    buffer = PartialRolloutBuffer(cfg.rollout.partial.max_age)
    draw_groups(buffer, sets, Tok(), run_settings(cfg).rollout, 6, cfg.run.seed)
    trajs, _ = buffer.pending(6)
    assert [t.task_index for t in trajs[::2]] == sample_prompts(40, 3, 5, 6)
    assert len(trajs) == 6 and all(t.params.seed == seeds.sampling_seed(5, 6, t.key) for t in trajs)


def test_ptx_batches_use_ptx_seed():
    samples = [PtxSample(f"p{i}", f"r{i}") for i in range(30)]
    batches = ptx_batches(samples, Tok(), batch_size=4, steps=2, seed=2, iteration=8)
    rng = random.Random(seeds.ptx_seed(2, 8))
    chosen = [[samples[rng.randrange(30)] for _ in range(4)] for _ in range(2)]
    assert [b.prompts for b in batches] == [[Tok().encode(s.prompt) for s in c] for c in chosen]


class Judge(Env):
    """A group-level environment (it defines score_group): the iteration's runner gets the policy attached as
    critic."""

    def score_group(self, task, responses):
        return [0.0] * len(responses), {}


register("seeds-judge-test", Judge)


class Recorder:
    """The calls the callers make on the rollout replicas and the trainers (both handles in one), with the seed each
    passed."""

    def __init__(self):
        self.generate_seeds, self.train_seeds = [], []
        self.num_buckets, self.max_context = 1, 128
        self.rollouts = self.trainers = self
        self.stop = StopWatch(None)  # no stop is ever asked of this loop

    def __len__(self):  # one trainer rank
        return 1

    def generate(self, prompts, params, seed, on_chunk=None):
        self.generate_seeds.append(seed)
        return [SimpleNamespace(token_ids=[]) for _ in prompts]

    def rollout(self, pending, budget, on_worker=None):
        return [], {}

    def train(self, batches, on_step=None):
        return []

    def weights_version(self):
        return 0

    def update_weights(self, changed=True):
        pass

    def onload(self):
        return {}

    offload = onload

    def sleep(self):
        pass

    wake = sleep


def test_policy_critic_uses_critic_seed():
    cfg = parse_config({"run": {"seed": 3}, "env": {"name": "seeds-judge-test"}})
    sets = TaskSets([Task("t", "q", "")], [], cfg.env_entries, [0])
    cluster = Recorder()
    runner = episode_runner(cluster, cfg, sets, Tok(), task_types(cfg), 4)
    try:
        runner.critic(["judge this"])
    finally:
        runner.close()
    assert cluster.generate_seeds == [seeds.critic_seed(3, 4)]


def test_iteration_uses_episode_and_train_seeds(monkeypatch):
    cfg = parse_config({"run": {"seed": 9, "iterations": 100, "eval_every": 50},
                        "rollout": {"prompts_per_iteration": 2, "samples_per_prompt": 2}})
    tasks = ArithmeticEnv.generate_tasks(20, seed=0)
    sets = TaskSets(tasks, tasks[:2], cfg.env_entries, [0] * 20, [0, 0])
    played = []
    monkeypatch.setattr(rl.loop.stream, "run_rollout",
                        lambda c, b, episodes, t, it, *a: played.append(seeds.episode_seed(episodes.run_seed, it))
                        or (0, {}))
    monkeypatch.setattr(rl.loop.stream, "reward_phase", lambda *a: (
        [make_sample(0, [1], [2], [-1.0], 1.0)], {"env_errors": 0, "trained_samples": 1}))
    cluster = Recorder()
    monkeypatch.setattr(rl.loop.controller, "plan_update", lambda *a: cluster.train_seeds.append(a[3]) or [])
    with Progress(disable=True) as progress:
        settings = run_settings(cfg)
        run = Run(cfg=cfg, settings=settings, run_dir=ROOT, start_dir=ROOT, tasks=sets, tok=Tok(), ptx=[],
                  cluster=cluster, buffer=PartialRolloutBuffer(2),
                  episodes=Episodes(None, Tok(), "auto", 8, 64, cfg.run.seed), progress=progress, console=None)
        iteration(run, 7)
    assert played == [seeds.episode_seed(9, 7)] and cluster.train_seeds == [seeds.train_seed(9, 7)]


class Again(Env):
    """A multi-turn environment that never ends: every turn of the episode asks for another."""

    multi_turn = True

    def step(self, action):
        return "again", 0.0, False, False, {}


register("seeds-multi-test", Again)


def test_multi_turn_requests_use_turn_seed():
    cfg = parse_config({"env": {"name": "seeds-multi-test"}, "rollout": {"samples_per_prompt": 2, "max_turns": 2}})
    runner = SimpleNamespace(make_env=lambda entry: Again(),
                             run_calls=lambda calls: [(fn(), None) for fn, _ in calls])
    got = []

    class Cluster:
        def rollout(self, samples, token_budget, on_worker=None, contexts=None):
            got.extend(s.params.seed for s in samples)
            return [TurnResult(s.key, [65], [-1.0], "stop") for s in samples], [COUNTS]

    play_episodes(Cluster(), cfg, Tok(), runner, [(3, cfg.env, Task("t", "q", ""))], it=1, max_context=64)
    assert got == [seeds.turn_seed(seeds.episode_seed(0, 1), key, turn) for turn in range(2) for key in (6, 7)]


def test_cluster_chunks_use_chunk_seed(monkeypatch):
    sent = []

    class Ref:  # an object ref: hashed by identity, its value the chunk's completions
        def __init__(self, prompts, params, seed):
            sent.append(seed)
            self.value = [SimpleNamespace() for _ in prompts]

    worker = SimpleNamespace(generate=SimpleNamespace(remote=Ref))
    fake_ray = SimpleNamespace(wait=lambda pending, num_returns, timeout=None: (pending[:1], pending[1:]),
                               get=lambda ref: ref.value)
    monkeypatch.setattr(rl.loop.rollout_manager, "ray", fake_ray)
    monkeypatch.setattr(rl.loop.recovery, "ray", fake_ray)
    settings = run_settings(parse_config({"rollout": {"max_batch": 2}}))
    rollouts = RolloutManager(settings, [worker, worker], trainers=None, restarts=None, respawn=None)
    rollouts.generate([[1]] * 5, [None] * 5, seed=11)
    assert sent == [seeds.chunk_seed(11, i) for i in range(3)]


def test_no_seed_arithmetic_left_in_rl():
    """Every generator in rl/ is seeded from rl.seeds (or with a seed a caller got from it): no ad-hoc arithmetic
    such as ``seed * 1_000_003 + it``, which is how two streams came to share seeds (before rl.seeds, this test
    flagged controller, data, ptx, rewards, difficulty, multiturn, critic_loop and cluster)."""
    seeded = {"Random", "manual_seed", "default_rng", "RandomState", "SeedSequence"}  # a seed as 1st argument
    bad = []
    for path in sorted((ROOT / "rl").rglob("*.py")):
        if path.name == "seeds.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):  # a seed argument computed in place
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                args = [k.value for k in node.keywords if k.arg == "seed"] + (node.args if name in seeded else [])
                bad += [f"{path.name}:{a.lineno}: {ast.unparse(a)}" for a in args if isinstance(a, ast.BinOp)]
            elif isinstance(node, ast.BinOp):  # arithmetic on anything named like a seed
                names = {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node)}
                if any("seed" in n.lower() for n in names):
                    bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


@pytest.mark.parametrize("stream", sorted(ITERATION_STREAMS))
def test_iteration_streams_take_run_seed_and_iteration(stream):
    f = ITERATION_STREAMS[stream]
    assert list(f.__annotations__) == ["run_seed", "iteration", "return"]
    assert f.__doc__ and "\n" not in f.__doc__.strip()
