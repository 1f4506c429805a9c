"""End to end on a real local Ray cluster: outputs, bitwise weight update, exact resume."""

import json

import pytest
import ray
import torch
import transformers
from safetensors.torch import load_file

from rl.checkpoint import LoopState, latest_checkpoint, save_checkpoint
from rl.cluster import Cluster
from rl.config import parse_config
from rl.controller import train
from rl.warmstart import prepare_model

TINY = {
    "run": {"iterations": 4, "eval_every": 2, "save_every": 2},
    "warmstart": {"steps": 15, "num_examples": 300, "batch_size": 16, "vocab_size": 400,
                  "architecture": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "num_key_value_heads": 2}},
    "env": {"num_train": 200, "num_eval": 24},
    "rollout": {"prompts_per_iteration": 4, "samples_per_prompt": 4, "max_tokens": 24, "max_batch": 8},
    "algorithm": {"minibatches": 2, "micro_batch": 8},
    "optimizer": {"lr": 1e-3},
    "checkpoint_engine": {"bucket_mb": 0.01},  # ~10 KiB: many buckets, tensors split across them
}


def tiny(**sections):
    raw = json.loads(json.dumps(TINY))
    for k, v in sections.items():
        raw[k].update(v)
    return parse_config(raw)


@pytest.mark.parametrize("sleep_level", [1, 2])
def test_weight_update_makes_inference_bitwise_equal(ray_cluster, sleep_level):
    """Rollout, sleep (level 2 discards the inference weights), train, wake, update: the inference
    engine then holds the trainer's weights bit for bit and generates again."""
    cfg = tiny(rollout={"sleep_level": sleep_level})
    model_dir = prepare_model(cfg)
    with Cluster(cfg, str(model_dir)) as cluster:
        assert cluster.num_buckets > 3
        before = ray.get(cluster.rollouts[0].state_dict.remote())
        from rl.algorithm import Sample

        prompts = [[5, 6, 7]] * 4
        outs = cluster.generate(prompts, 1.0, 8, seed=0)
        cluster.sleep_rollouts()
        samples = [Sample(0, o.prompt_ids, o.token_ids, o.logprobs, float(i % 2)) for i, o in enumerate(outs)]
        cluster.train(samples, 1.0, seed=0)
        trained = ray.get(cluster.trainers[0].state_dict.remote())
        assert any(not torch.equal(trained[k], before[k]) for k in trained)
        cluster.wake_rollouts()
        cluster.update_weights()
        after = ray.get(cluster.rollouts[0].state_dict.remote())
        assert len(cluster.generate(prompts, 1.0, 8, seed=1)) == 4
    assert set(after) == set(trained)
    for k in trained:
        assert torch.equal(after[k], trained[k]), k


def test_run_outputs_and_exact_resume(ray_cluster, tmp_path):
    full = tmp_path / "full"
    summary = train(tiny(), full)
    assert {"initial_accuracy", "final_accuracy", "iterations", "wall_s"} <= set(summary)
    assert summary["iterations"] == 4
    records = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    assert {"reward_mean", "response_len", "truncation_rate", "time_rollout", "time_train",
            "time_weight_update"} <= set(records[0])
    assert (full / "curves.png").stat().st_size > 10_000
    hf = transformers.AutoModelForCausalLM.from_pretrained(full / "final")
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained(full / "final").eos_token == "<|endoftext|>"

    # stop after 2 iterations, then resume to 4: same weights and metrics as the uninterrupted run
    split = tmp_path / "split"
    train(tiny(run={"iterations": 2}), split)
    ckpt, state = latest_checkpoint(split)
    assert state.iteration == 1 and (ckpt / "optimizer.pt").is_file()
    (split / "config.yaml").write_text((split / "config.yaml").read_text().replace("iterations: 2", "iterations: 4"))
    from rl.config import load_config

    train(load_config(split / "config.yaml"), split, resume=True)
    a = load_file(str(full / "final" / "model.safetensors"))
    b = load_file(str(split / "final" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    resumed = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in resumed] == [r["reward_mean"] for r in records]


def test_failed_save_leaves_last_checkpoint_intact(tmp_path):
    def good(d):
        (tmp_path / "tok").mkdir(exist_ok=True)
        open(f"{d}/model.safetensors", "w").write("weights")

    save_checkpoint(tmp_path, LoopState(4, 0.1, 1.0), good, tmp_path / "tok", keep=2)

    def broken(d):
        open(f"{d}/model.safetensors", "w").write("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        save_checkpoint(tmp_path, LoopState(9, 0.1, 2.0), broken, tmp_path / "tok", keep=2)
    ckpt, state = latest_checkpoint(tmp_path)
    assert state.iteration == 4 and (ckpt / "model.safetensors").read_text() == "weights"
