"""The disaggregated placement (``cluster.placement``): trainers and rollout replicas as separate Ray workers that run
at once, the replicas at most ``algorithm.max_staleness`` (k) weight versions ahead (rl/loop/stream.py).

* k = 0 is the colocated loop's run (here stopped while its trainer waits for a batch, and resumed): the same rewards
  every iteration and the same final weights, bit for bit, on the same seeds (and the weights moved: the comparison
  is not of two untrained models);
* with k = 1 and a token budget that pauses responses over updates, the trainer never trains a sample whose oldest
  token is more than one version old (a carried-over group that aged past it is left out, and counted), while
  batches made ahead of the trainer are trained one version old;
* the filter itself against samples whose versions are set by hand; bad settings in one line.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import rl
from engines.inference.sampling import SamplingParams
from rl.errors import UserError
from rl.loop import stream
from rl.loop.checkpoint import list_checkpoints
from rl.loop.controller import RunStopped
from rl.loop.stream import eligible
from rl.sample import Sample, TaskType
from tests.test_run import TINY


def run_config(model_dir, reward_file, **sections) -> dict:
    """Three iterations of TINY's model; every group trains (a reward that differs, equal groups kept), so each
    iteration's update changes the weights and versions advance."""
    raw = json.loads(json.dumps({k: v for k, v in TINY.items() if k not in ("warmstart",)}))
    raw["model"] = {"path": str(model_dir)}
    raw["run"] = {"iterations": 3, "eval_every": 3, "save_every": 3, "eval_samples": 0}
    raw["env"] = {"name": "arithmetic", "num_train": 200, "num_eval": 8,
                  "reward": {"function": f"{reward_file}:digits"}}
    raw["rollout"].update(truncation_penalty=-0.5)
    raw["algorithm"].update(drop_equal_reward_groups=False)
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return raw


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_k0_is_the_colocated_run_bit_for_bit(ray_cluster, model_dir, reward_file, tmp_path, monkeypatch):
    """The disaggregated run is also stopped (rl.loop.stop) while its trainer waits for iteration 2's batch: iteration
    1's checkpoint holds its state (the colocated stop that saves it is tests/test_run.py), so it ends at once; its
    resume still ends on the colocated run's weights."""
    rl.train(run_config(model_dir, reward_file), tmp_path / "colocated")
    k0 = tmp_path / "k0"
    real_rollout, real_take, waiting = stream.run_rollout, stream.RolloutStream.take, threading.Event()

    def take(self, it):
        if it == 2:
            waiting.set()
        return real_take(self, it)

    def stop_at_2(rollouts, buffer, episodes, tasks, it, *rest):
        if it == 2:  # asked once the trainer waits for the batch (asked sooner, it is answered after iteration 1)
            assert waiting.wait(120)
            (k0 / "stop-requested").write_text("node-1 1700000000\n")
        return real_rollout(rollouts, buffer, episodes, tasks, it, *rest)

    monkeypatch.setattr(stream.RolloutStream, "take", take)
    monkeypatch.setattr(stream, "run_rollout", stop_at_2)
    raw = run_config(model_dir, reward_file, cluster={"placement": "disaggregated"}, algorithm={"max_staleness": 0})
    raw["run"]["save_every"] = 1  # iteration 1's checkpoint is there already: the stop saves nothing more
    with pytest.raises(RunStopped, match="during iteration 2's rollout .*: iter_000001 holds its state already; "):
        rl.train(raw, k0)
    monkeypatch.setattr(stream, "run_rollout", real_rollout)
    monkeypatch.setattr(stream.RolloutStream, "take", real_take)
    assert [p.name for p in list_checkpoints(k0)] == ["iter_000000", "iter_000001"]
    assert not (k0 / "stop-requested").exists()
    rl.train(run_dir=k0, resume=True)
    a, b = records(tmp_path / "colocated"), records(tmp_path / "k0")
    assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
    assert [r["optimizer_steps"] for r in a] == [r["optimizer_steps"] for r in b] and all(r["optimizer_steps"]
                                                                                          for r in a)
    assert all(r["staleness_max"] == 0 and r["stale_dropped"] == 0 for r in b)
    wa = load_file(str(tmp_path / "colocated" / "final" / "model.safetensors"))
    wb = load_file(str(tmp_path / "k0" / "final" / "model.safetensors"))
    start = load_file(str(model_dir / "model.safetensors"))
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], start[k]) for k in start)


def test_no_sample_older_than_k_is_trained(ray_cluster, model_dir, reward_file, tmp_path):
    """k = 1, a token budget that pauses most responses, paused ones kept up to 4 iterations (partial.max_age)."""
    raw = run_config(model_dir, reward_file, cluster={"placement": "disaggregated"}, algorithm={"max_staleness": 1},
                     rollout={"partial": {"token_budget": 150, "max_age": 4}})
    raw["run"]["iterations"] = 6
    rl.train(raw, tmp_path / "k1")
    recs = records(tmp_path / "k1")
    assert all(r["staleness_max"] <= 1 for r in recs)
    assert sum(r["stale_dropped"] for r in recs) > 0  # groups that aged past k were there, and left out
    assert sum(r.get("staleness/1", 0) for r in recs) > 0  # and one version old ones were trained
    for r in recs:  # what was trained is what the histogram counts
        assert r["trained_samples"] == sum(v for k, v in r.items() if k.startswith("staleness/"))
        assert {"time_trainer_idle", "time_rollout_idle", "queue_depth", "stale_token_share",
                "time_update_pause"} <= set(r)


def _sample(key: int, group: int, segments: list[tuple[int, int]], length: int) -> Sample:
    s = Sample(key, group, 0, TaskType("t", 8, 0.0, None), np.array([1, 2]), SamplingParams(1.0, 8), 0)
    s.response_ids, s.logprobs = np.arange(length), np.zeros(length)
    s.segments, s.status = np.array(segments).reshape(-1, 2), "finished"
    return s


def test_eligible_keeps_groups_within_k_versions_and_counts_their_tokens():
    """Trainer at version 5, k = 1: group 0's samples are from versions 4 and 5 (kept); group 1 has one sample
    begun at version 3 (too old: its whole group is left out); the stale token share counts tokens by segment."""
    samples = [_sample(0, 0, [(0, 4), (3, 5)], 4),  # 3 tokens of version 4, 1 of version 5
               _sample(1, 0, [(0, 5)], 2),
               _sample(2, 1, [(0, 3), (1, 5)], 3),
               _sample(3, 1, [(0, 5)], 1)]
    kept, stats = eligible(samples, version=5, k=1)
    assert [s.key for s in kept] == [0, 1]
    assert stats == {"staleness/0": 1, "staleness/1": 1, "staleness_max": 1, "stale_token_share": 0.5,
                     "stale_dropped": 2}
    assert [s.key for s in eligible(samples, version=5, k=2)[0]] == [0, 1, 2, 3]
    assert eligible(samples, version=5, k=0)[0] == []


def test_an_aborted_sample_starts_again_from_its_prompt():
    """rollout.on_update: abort forgets a paused single-turn sample's tokens; a done or multi-turn one cannot be."""
    s = _sample(0, 0, [(0, 2), (2, 3)], 4)
    assert s.oldest_version() == 2
    s.status = "paused"
    s.restart()
    assert (len(s.response_ids), len(s.logprobs), len(s.segments), s.status) == (0, 0, 0, "running")
    assert s.oldest_version() is None and list(s.prompt_ids) == [1, 2]
    with pytest.raises(ValueError, match="only a single-turn sample still generating"):
        _sample(1, 0, [(0, 2)], 1).restart()  # finished


@pytest.mark.parametrize(("raw", "message"), [
    ({"algorithm": {"max_staleness": -1}, "cluster": {"placement": "disaggregated"}},
     r"algorithm\.max_staleness: Input should be greater than or equal to 0"),
    ({"algorithm": {"max_staleness": 1}}, r"algorithm\.max_staleness counts the weight versions .* set "
                                          r"cluster\.placement: disaggregated"),
    ({"cluster": {"rollout_workers": 2}}, r"cluster\.rollout_workers: colocated workers hold one replica each"),
    ({"cluster": {"placement": "disaggregated", "rollout_workers": 0}},
     r"cluster\.rollout_workers: Input should be greater than or equal to 1"),
    ({"cluster": {"placement": "disaggregated", "workers": 0}}, r"cluster\.workers: Input should be greater"),
    ({"cluster": {"placement": "disaggregated", "gpus_per_worker": 1}},
     r"disaggregated runs on CPU workers for now: its point-to-point transport .* NCCL links"),
])
def test_bad_disaggregated_settings_are_one_line(raw, message):
    with pytest.raises(UserError, match=message):
        rl.parse_config(raw)


def test_disaggregated_replicas_never_sleep_and_stale_runs_correct_off_policy_samples():
    from rl.settings import sleep_level

    cfg = rl.parse_config({"cluster": {"placement": "disaggregated"}})
    assert sleep_level(cfg) == (0, "disaggregated: the replicas never sleep")
    assert cfg.staleness == 1 and rl.parse_config({}).staleness is None
    with pytest.raises(UserError, match="disaggregated replicas never sleep"):
        sleep_level(rl.parse_config({"cluster": {"placement": "disaggregated"}, "rollout": {"sleep_level": 1}}))
