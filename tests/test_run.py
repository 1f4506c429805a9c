"""End to end on a real local Ray cluster: outputs, bitwise weight update, exact resume."""

import json
import shutil

import numpy as np
import pytest
import ray
import torch
import transformers
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from engines.inference.sampling import SamplingParams
from engines.model.io.hf_io import read_config
from envs.arithmetic import ArithmeticEnv
from rl.config import parse_config
from rl.loop import stream
from rl.loop.checkpoint import PARTIAL_FILE, LoopState, SaveFailed, latest_checkpoint, save_checkpoint
from rl.loop.cluster import Cluster
from rl.loop.controller import RunStopped, train
from rl.rollout.partial import load_state
from rl.settings import for_model
from rl.setup.memory import estimate
from rl.setup.warmstart import prepare_model
from tests.conftest import make_sample, train_on

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
        raw.setdefault(k, {}).update(v)
    return parse_config(raw)


K2_TINY = {"family": "deepseek_v3", "moe": {"q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                                             "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4,
                                             "moe_intermediate_size": 16}}


@pytest.mark.parametrize(("sleep_level", "workers", "dtype", "arch"),
                         [(1, 1, None, {}), (2, 1, None, {}), pytest.param(1, 2, None, {}, marks=pytest.mark.slow),
                          (1, 1, "bfloat16", {}),
                          (2, 2, "bfloat16", K2_TINY)])
def test_weight_update_makes_inference_bitwise_equal(ray_cluster, sleep_level, workers, dtype, arch):
    """Rollout, sleep (level 2 discards the inference weights), onload, train (FSDP2-sharded over
    two workers), offload, wake, update from the offloaded shards: every inference engine then holds
    the trainer's full weights bit for bit (cast to bfloat16 where its replica is bfloat16; the Kimi K2
    layout's experts and latent attention included; fused q/k/v and gate/up in the replica) and
    generates again. The MoE case trains expert-parallel (trainer.expert_parallel: each trainer holds half the
    experts, the replicas still receive all of them) and replays the rollout's routes (algorithm.routing_replay): the
    completions carry each read token's experts across Ray, and the update reports the routers' health."""
    ws = json.loads(json.dumps(TINY["warmstart"]))
    ws["architecture"].update(arch)
    replay = {"routing_replay": "rollout" if arch else "off"}
    cfg = tiny(rollout={"sleep_level": sleep_level, "dtype": dtype}, cluster={"workers": workers}, warmstart=ws,
               algorithm=replay, trainer={"expert_parallel": 2} if arch else {})
    model_dir = prepare_model(cfg)
    with Cluster(for_model(cfg, str(model_dir)), str(model_dir)) as cluster:
        assert cluster.num_buckets > 3
        before = ray.get(cluster.rollouts[0].state_dict.remote())
        prompts = [[5, 6, 7]] * 4
        params = [SamplingParams(1.0, 8)] * 4
        cluster.trainers.offload()
        outs = cluster.rollouts.generate(prompts, params, seed=0)
        cluster.rollouts.sleep()
        cluster.trainers.onload()
        samples = [make_sample(0, o.prompt_ids, o.token_ids, o.logprobs, float(i % 2)) for i, o in enumerate(outs)]
        for s, o in zip(samples, outs, strict=True):
            s.routed_experts = o.routed_experts
            assert (o.routed_experts is not None) == bool(arch)
            if arch:
                assert o.routed_experts.shape[0] == len(o.prompt_ids) + len(o.token_ids) - 1
        metrics = train_on(cluster, samples)
        if arch:  # bf16 trainer against a bf16 replica: its own routers mostly agree, the metric is measured
            assert 0 <= metrics[0]["route_mismatch"] < 0.5 and metrics[0]["router_entropy"] > 0
        cluster.trainers.offload()
        trained = ray.get([t.state_dict.remote() for t in cluster.trainers])[0]
        assert any(not torch.equal(trained[k], before[k]) for k in trained)
        cluster.rollouts.wake()
        cluster.rollouts.update_weights()
        after = [ray.get(r.state_dict.remote()) for r in cluster.rollouts]
        assert len(cluster.rollouts.generate(prompts, params, seed=1)) == 4
    # the cast reference; the router's score-correction bias stays float32 in any replica, as DeepSeek stores it
    want = {k: v if k.endswith("e_score_correction_bias") else v.to(getattr(torch, dtype or "float32"))
            for k, v in trained.items()}
    for replica in after:
        assert set(replica) == set(trained)
        for k in trained:
            assert replica[k].dtype == want[k].dtype and torch.equal(replica[k], want[k]), k


def test_run_outputs_and_exact_resume(ray_cluster, tmp_path, monkeypatch):
    """A run with partial rollout and PTX: its outputs, and a resume that continues exactly (the
    partial-rollout buffer is part of the checkpoint), here from a stop asked in the middle of an iteration."""
    ptx = tmp_path / "ptx.jsonl"
    ptx.write_text("".join(json.dumps({"prompt": t.prompt, "response": t.meta["solution"]}) + "\n"
                           for t in ArithmeticEnv.generate_tasks(20, seed=5)))
    features = {"rollout": {"partial": {"token_budget": 120, "max_age": 1}},
                "algorithm": {"ptx": {"data": str(ptx), "coef": 0.1, "batch_size": 4}}}
    full = tmp_path / "full"
    summary = train(tiny(**features), full)
    assert {"initial_accuracy", "final_accuracy", "iterations", "wall_s"} <= set(summary)
    assert summary["iterations"] == 4
    records = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    assert {"reward_mean", "response_len", "truncation_rate", "time_rollout", "time_train", "time_offload",
            "time_onload", "time_weight_update", "ptx_loss", "max_logit", "max_logit_layer0", "partial_paused",
            "partial_resumed", "partial_dropped"} <= set(records[1])
    assert sum(r["partial_paused"] for r in records) > 0 and sum(r["partial_resumed"] for r in records) > 0
    assert all(r["rollout_tokens"] <= 120 + 16 for r in records)  # budget + at most one token per slot
    assert (full / "curves.png").stat().st_size > 10_000
    hf = transformers.AutoModelForCausalLM.from_pretrained(full / "final")
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained(full / "final").eos_token == "<|endoftext|>"

    # a stop asked while iteration 2 generates (the chart's preStop, rl.loop.stop): iteration 1's state is saved,
    # though save_every would not save it, with the partial-rollout buffer as iteration 2 found it; resumed: the same
    # weights and metrics as the uninterrupted run
    split = tmp_path / "split"
    real_rollout = stream.run_rollout

    def stop_at_2(rollouts, buffer, episodes, tasks, it, *rest):
        if it == 2:  # iteration 2's groups are drawn: the buffer differs from the one iteration 2 started from
            (split / "stop-requested").write_text("node-1 1700000000\n")
        return real_rollout(rollouts, buffer, episodes, tasks, it, *rest)

    monkeypatch.setattr(stream, "run_rollout", stop_at_2)
    with pytest.raises(RunStopped, match="during iteration 2's rollout .*: its state saved as iter_000001; "):
        train(tiny(run={"save_every": 3}, **features), split)
    monkeypatch.setattr(stream, "run_rollout", real_rollout)
    assert not (split / "stop-requested").exists()  # answered: the waiting preStop lets its pod go
    ckpt, state = latest_checkpoint(split)
    assert state.iteration == 1 and (ckpt / "trainer" / "__0_0.distcp").is_file()
    ended = full / "checkpoints" / "iter_000001"  # what full saved as iteration 1 ended: all of it but the time
    assert {**json.loads((ckpt / "state.json").read_text()), "wall_s": 0} == \
        {**json.loads((ended / "state.json").read_text()), "wall_s": 0}
    at_1 = load_state(ended / PARTIAL_FILE)
    stopped = load_state(ckpt / PARTIAL_FILE)
    assert {k: v for k, v in stopped.items() if k != "arrays"} == {k: v for k, v in at_1.items() if k != "arrays"}
    assert stopped["samples"] and all(np.array_equal(stopped["arrays"][k], v) for k, v in at_1["arrays"].items())
    # what rl check-config says a checkpoint takes on the claim: the model's file as counted (its header apart), and
    # the tensors of the trainer's shards (as their metadata lists them) exactly the master weights and optimizer
    # state counted; the files' per-tensor framing is small next to a real model's tensors, not a tiny one's
    est = estimate(tiny(**features), read_config(ckpt), 64)
    assert 0 < (ckpt / "model.safetensors").stat().st_size - est.params * 4 < 0.05 * est.params * 4
    meta = FileSystemReader(str(ckpt / "trainer")).read_metadata().state_dict_metadata.values()
    tensors = sum(m.size.numel() * m.properties.dtype.itemsize for m in meta if hasattr(m, "properties"))
    assert abs(tensors - (est.trainer_weights + est.optimizer)) <= 64 + 0.001 * tensors, (tensors, est)
    from rl.config import load_config

    train(load_config(split / "config.yaml"), split, resume=True)
    a = load_file(str(full / "final" / "model.safetensors"))
    b = load_file(str(split / "final" / "model.safetensors"))
    start = load_file(str(prepare_model(tiny(**features)) / "model.safetensors"))
    assert any(not torch.equal(a[k], start[k]) for k in a)  # it trained (PTX here: the rewards are all 0)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not (full / "final" / "trainer").exists()  # the final model is weights only
    resumed = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in resumed] == [r["reward_mean"] for r in records]


@pytest.mark.slow
def test_two_worker_run_resumes_exactly_and_on_one_worker(ray_cluster, tmp_path):
    """FSDP2 over two workers: each rank writes its shards of the trainer state; a resume with the same worker
    count ends bit for bit where the uninterrupted run ends, and one on a single worker reads the same state
    (resharded) and trains on. The untrained model gets no answer right, so a truncation penalty gives its groups
    rewards that differ (with π_old recomputed exactly, equal rewards give a zero gradient); π_old is recomputed
    (the ranks exchange their shares) and layers are checkpointed, both deterministic."""
    two = {"cluster": {"workers": 2}, "run": {"iterations": 3, "eval_every": 3, "save_every": 2},
           "rollout": {"truncation_penalty": -0.5},
           "algorithm": {"drop_equal_reward_groups": False, "recompute_old_logprobs": True},
           "trainer": {"activation_checkpointing": True}}
    train(tiny(**two), tmp_path / "full")
    cut = json.loads(json.dumps(two))
    cut["run"]["iterations"] = 2
    train(tiny(**cut), tmp_path / "split")
    ckpt, _ = latest_checkpoint(tmp_path / "split")
    assert {p.name for p in (ckpt / "trainer").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    from rl.config import load_config

    shutil.copytree(tmp_path / "split", tmp_path / "one")
    train(load_config(tmp_path / "one" / "config.yaml", ["run.iterations=3", "cluster.workers=1"]),
          tmp_path / "one", resume=True)
    records = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2] and records[-1]["optimizer_steps"] > 0
    # measured in the recompute pass every iteration: float32 on both sides agrees to rounding
    assert all(0 <= r["logprob_diff_max"] < 1e-4 and r["entropy"] > 0 for r in records)
    train(load_config(tmp_path / "split" / "config.yaml", ["run.iterations=3"]), tmp_path / "split", resume=True)
    a = load_file(str(tmp_path / "full" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "final" / "model.safetensors"))
    start = load_file(str(prepare_model(tiny(**two)) / "model.safetensors"))
    assert any(not torch.equal(a[k], start[k]) for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_failed_save_leaves_last_checkpoint_intact(tmp_path):
    from safetensors.torch import save_file

    def good(d):
        (tmp_path / "tok").mkdir(exist_ok=True)
        save_file({"w": torch.ones(3)}, f"{d}/model.safetensors")
        open(f"{d}/config.json", "w").write("{}")

    save_checkpoint(tmp_path, LoopState(iteration=4, initial_accuracy=0.1, wall_s=1.0), good, tmp_path / "tok", keep=2)

    def broken(d):
        open(f"{d}/model.safetensors", "w").write("half")
        raise OSError("disk full")

    with pytest.raises(SaveFailed, match=r"iter_000009 failed: OSError: disk full .*iter_000004, is intact"):
        save_checkpoint(tmp_path, LoopState(iteration=9, initial_accuracy=0.1, wall_s=2.0), broken, tmp_path / "tok",
                        keep=2)
    assert not (tmp_path / "checkpoints" / "iter_000009.tmp").exists()  # what it wrote is gone
    ckpt, state = latest_checkpoint(tmp_path)
    assert state.iteration == 4 and torch.equal(load_file(str(ckpt / "model.safetensors"))["w"], torch.ones(3))


def _qwen_format_dir(d, tokenizer_corpus: list[str]) -> None:
    """A Qwen3-format directory made here: random tiny Qwen3 (vocabulary padded past the tokenizer's, as
    Qwen's is), a byte-level BPE with ChatML special tokens and chat template, EOS list in generation_config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(tokenizer_corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                  pad_token="<|endoftext|>")
    hf_tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf_tok.save_pretrained(d)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=256, eos_token_id=2, pad_token_id=0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    transformers.GenerationConfig(eos_token_id=[2, 0], pad_token_id=0).save_pretrained(d)


def test_a_qwen3_format_directory_trains_with_model_path(ray_cluster, tmp_path):
    """`model.path` on a Qwen3-format directory: chat-format tasks rendered with its template, a run, and a
    final model that transformers loads as Qwen3 with the tokenizer and generation config carried over."""
    tasks = ArithmeticEnv.generate_tasks(60, seed=3)
    _qwen_format_dir(tmp_path / "qwen", [t.prompt + t.meta["solution"] for t in tasks])
    for name, part in (("train", tasks[:50]), ("eval", tasks[50:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(
            {"messages": [{"role": "user", "content": t.prompt}], "answer": t.answer}) + "\n" for t in part))
    # this untrained model's rewards are all 0: equal-reward groups are kept so that it trains all the same
    cfg = tiny(model={"path": str(tmp_path / "qwen")}, run={"iterations": 2, "eval_every": 1, "save_every": 2},
               env={"train_tasks": str(tmp_path / "train.jsonl"), "eval_tasks": str(tmp_path / "eval.jsonl")},
               algorithm={"drop_equal_reward_groups": False})
    summary = train(cfg, tmp_path / "run")
    assert summary["iterations"] == 2
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] == r["loss"] for r in records)  # trained: a finite loss every iteration
    final = tmp_path / "run" / "final"
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    start = load_file(str(tmp_path / "qwen" / "model.safetensors"))
    assert any(not torch.equal(model.state_dict()[k], v) for k, v in start.items())
    tok = transformers.AutoTokenizer.from_pretrained(final)
    assert tok.chat_template and json.loads((final / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


def _fp8_copy(model_dir, tmp_path, block: int):
    """The model directory as Kimi K2 ships its weights: block-FP8 matrices with float32 scale grids, in
    two files, and a config.json that says so."""
    import copy
    import shutil

    from safetensors.torch import save_file

    from engines.model.io.hf_io import load_pretrained
    from engines.model.layout import hub_state
    from engines.model.native.fp8 import to_fp8

    d = tmp_path / "fp8"
    shutil.copytree(model_dir, d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / "model.safetensors.index.json").unlink(missing_ok=True)
    model = load_pretrained(model_dir, torch.bfloat16)
    tensors = {k: v.contiguous() for k, v in hub_state(to_fp8(copy.deepcopy(model), block)).items()}
    names = sorted(tensors)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n] for n in part}, str(d / f"model-{i + 1:05d}-of-00002.safetensors"))
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    (d / "config.json").write_text(json.dumps(raw))
    return d, tensors


# slow tier (49 s): make test has its parts, test_checkpoint_engine's read-once FP8 start-up, FP8 updates of shards
# whose rows split blocks, against the reference quantisation, and a restarted replica's catch-up; this composes them
# on Ray
@pytest.mark.slow
def test_fp8_checkpoint_is_read_once_and_fp8_updates_are_exact(ray_cluster, tmp_path):
    """Kimi K2's path on two workers: the FP8 checkpoint is read once (each file by one trainer) into the
    FP8 replicas as stored and into the trainers' shards dequantised; an update then quantises the
    trainers' FSDP2 shards bucket by bucket (blocks of 32 rows cut in two by the 16-row shards) and every
    replica holds exactly the reference quantisation of the trainer's weights, and generates. A restarted
    engine then copies another's weights point to point."""
    from checkpoint_engine.quantize import split_bands
    from engines.model.native.fp8 import dequantize, quantize

    ws = json.loads(json.dumps(TINY["warmstart"]))
    ws["architecture"].update(K2_TINY)
    cfg = tiny(rollout={"fp8": True, "dtype": "bfloat16"}, cluster={"workers": 2}, warmstart=ws)
    fp8_dir, stored = _fp8_copy(prepare_model(cfg), tmp_path, 32)
    with Cluster(for_model(cfg, str(fp8_dir)), str(fp8_dir)) as cluster:
        reads = cluster.startup_reads
        assert set(reads[0]).isdisjoint(reads[1]) and set(reads[0]) | set(reads[1]) == {
            f.name for f in fp8_dir.glob("*.safetensors")}
        replica = ray.get(cluster.rollouts[1].state_dict.remote())
        assert set(replica) == set(stored)
        for k, v in stored.items():  # FP8 tensors come as their bytes
            assert torch.equal(replica[k], v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v), k
        trainer = ray.get([t.state_dict.remote() for t in cluster.trainers])[0]  # collective
        for k, t in trainer.items():
            want = dequantize(stored[k], stored[k + "_scale_inv"], 32) if k + "_scale_inv" in stored else stored[k]
            assert torch.equal(t, want.to(t.dtype)), k
        plan = ray.get(cluster.trainers[0].weight_plan.remote())[0]
        assert split_bands(plan)  # some blocks' rows are on both trainers: their scales are combined
        cluster.rollouts.update_weights()
        after = [ray.get(r.state_dict.remote()) for r in cluster.rollouts]
        assert len(cluster.rollouts.generate([[5, 6, 7]] * 2, [SamplingParams(1.0, 4)] * 2, seed=0)) == 2
        # engine 1 restarts empty and copies engine 0's weights, point to point
        assert cluster.rollouts.restart(1, 0) > 0
        caught_up = ray.get(cluster.rollouts[1].state_dict.remote())
        assert all(torch.equal(caught_up[k], after[0][k]) for k in after[0])
        assert len(cluster.rollouts.generate([[5, 6, 7]] * 2, [SamplingParams(1.0, 4)] * 2, seed=0)) == 2
    quantised = [k for k in trainer if k + "_scale_inv" in stored]
    assert any(".experts." in k for k in quantised)
    for replica in after:
        for k, t in trainer.items():
            if k in quantised:
                q, s = quantize(t, 32)
                assert torch.equal(replica[k], q.view(torch.uint8)), k
                assert torch.equal(replica[k + "_scale_inv"], s), k
            elif not k.endswith("e_score_correction_bias"):
                assert torch.equal(replica[k], t.to(torch.bfloat16)), k


@pytest.mark.slow
def test_grpo_with_a_kl_penalty_scores_against_the_starting_model_also_after_a_resume(ray_cluster, tmp_path):
    """algorithm.kl_coef: each trainer rank (two, FSDP-sharded) holds the reference policy, read from the model the
    run started from, and every iteration that trains reports the KL to it. A run resumed from its checkpoint reads
    the same reference (the starting model, not the checkpoint) and ends with the weights and KL of the
    uninterrupted run, bit for bit."""
    from rl.config import load_config
    from tests.test_difficulty import EvenLength  # noqa: F401  (registers "even-length-test": rewards vary)

    raw = json.loads(json.dumps(TINY))
    raw["run"].update(iterations=3, eval_every=100, save_every=1, eval_samples=0)
    raw["cluster"] = {"workers": 2}
    raw["algorithm"].update(objective="grpo", kl_coef=0.05)
    # a response cut off at the budget scores below one that ends: groups differ in every iteration, so the last one
    # (after the resume) trains too, whatever the machine's rounding makes the samples
    raw["rollout"]["truncation_penalty"] = -0.5
    raw["envs"] = [{"name": "arithmetic", "weight": 0.01, "num_train": 50, "num_eval": 4},  # the warm start's
                   {"name": "even-length-test", "num_train": 200, "num_eval": 4}]
    full = tmp_path / "full"
    train(parse_config(raw), full)
    records = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r.get("optimizer_steps")]
    assert trained and all(r["kl_ref"] > 0 for r in trained) and "kl_ref" in records[-1]
    split = tmp_path / "split"
    train(parse_config({**raw, "run": {**raw["run"], "iterations": 2}}), split)
    (split / "config.yaml").write_text((split / "config.yaml").read_text().replace("iterations: 2", "iterations: 3"))
    train(load_config(split / "config.yaml"), split, resume=True)
    a, b = load_file(str(full / "final" / "model.safetensors")), load_file(str(split / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    resumed = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert resumed[-1]["kl_ref"] == records[-1]["kl_ref"]
