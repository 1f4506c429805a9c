"""The tiny vision-language warm start (``rl.setup.vision_warmstart``), as ``rl train`` builds it for an environment
with images (``model.path`` null, ``env.name: shapes``): a few SFT steps on shapes tasks lower the loss, the result is
cached by its settings, and the saved directory loads in transformers (``AutoModelForImageTextToText`` +
``AutoProcessor``) and in the project's ``VisionProcessor``, with an image of a shapes task becoming
``(image_size / 28) ** 2`` image tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

TINY = {"env": {"name": "shapes"},
        "warmstart": {"steps": 60, "batch_size": 8, "lr": 3e-3, "num_examples": 64, "vocab_size": 320,
                      "architecture": {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
                                       "intermediate_size": 128, "num_hidden_layers": 2,
                                       "max_position_embeddings": 256},
                      "vision": {"hidden_size": 64, "num_heads": 2}}}


def test_a_few_sft_steps_lower_the_loss_and_the_directory_loads():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from engines.model.hf.backend import load_hf_model
    from engines.model.text.processor import VisionProcessor
    from rl.config import parse_config
    from rl.setup.vision_warmstart import shapes_tasks
    from rl.setup.warmstart import prepare_model

    target = prepare_model(parse_config(TINY))  # the session's cache: the run below reuses it
    info = json.loads((target / "vision_warmstart.json").read_text())
    losses = [r["loss"] for r in info["log"]]
    assert len(losses) == 60 and all(v == v for v in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    assert info["recipe"]["steps"] == 60 and info["recipe"]["hidden"] == 64 and info["recipe"]["vision_dim"] == 64
    assert not target.with_name(target.name + ".tmp").exists()
    assert prepare_model(parse_config(TINY)) == target  # cached by its settings
    other = prepare_model(parse_config({**TINY, "warmstart": {**TINY["warmstart"], "steps": 1}}))
    assert other != target and json.loads((other / "vision_warmstart.json").read_text())["recipe"]["steps"] == 1

    model = AutoModelForImageTextToText.from_pretrained(target)
    processor = AutoProcessor.from_pretrained(target)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    vp = VisionProcessor.load(target)
    task = shapes_tasks(1, seed=5)[0]
    raw = vp.render(task.messages)
    assert vp.placeholders(raw) == 1
    e = vp.expand(raw, task.images)
    assert sum(e.mm_token_type_ids) == 4  # 56 px: 4x4 patches of 14 px, merged 2x2
    # transformers' own processor and model take the task, and the project's loader reads the same weights
    text = processor.apply_chat_template(task.messages, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[task.images[0].load()], return_tensors="pt")
    assert enc["input_ids"][0].tolist() == e.ids
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape[-1] >= len(processor.tokenizer) and torch.isfinite(logits).all()
    ours = load_hf_model(target)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ours.hf_model.state_dict().values(),
                                                 strict=True))


def test_a_language_model_vllm_cannot_attend_with_on_cpu_is_refused_in_one_line(tmp_path, monkeypatch):
    import pytest

    from rl.config import parse_config
    from rl.errors import UserError
    from rl.setup.warmstart import prepare_model

    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    arch = {**TINY["warmstart"]["architecture"], "num_attention_heads": 4, "num_key_value_heads": 2}  # head_dim 16
    with pytest.raises(UserError, match=r"hidden_size / num_attention_heads = 32 .*got 64 / 4"):
        prepare_model(parse_config({**TINY, "warmstart": {**TINY["warmstart"], "architecture": arch}}))
    assert not any(tmp_path.glob("warmstart-*/config.json"))


def test_rl_train_on_shapes_updates_vllm_exactly_and_saves_a_vision_language_model(ray_cluster, tmp_path):
    """``configs/shapes.yaml`` (the visual quick start) with the warm start above and a smaller batch: the run builds
    no other warm start, rolls out with images on vLLM (chosen automatically), moves an update of both towers into
    vLLM in place, after which vLLM's log-probs of what it samples equal the trainer's (fp32), and saves a
    ``final/`` that transformers loads as an image-text-to-text model with its processor."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rl.api import train
    from rl.config import parse_config
    from rl.setup.warmstart import prepare_model

    if not __import__("engines.inference.vllm_engine", fromlist=["x"]).vllm_available():
        import pytest

        pytest.skip("vLLM is not installed here (make setup installs it)")
    small = {"warmstart": TINY["warmstart"], "env.num_train": 64, "env.num_eval": 8, "run.iterations": 2,
             "run.eval_every": 2, "run.save_every": 2, "rollout.prompts_per_iteration": 4,
             "rollout.samples_per_prompt": 4, "rollout.max_tokens": 40, "rollout.max_batch": 16,
             "rollout.kv_cache_mb": 64, "algorithm.minibatches": 1, "algorithm.drop_equal_reward_groups": False,
             "optimizer.lr": 1e-2,
             "checkpoint_engine.bucket_mb": 0.01}
    summary = train(ROOT / "configs" / "shapes.yaml", tmp_path / "run", overrides=small)
    assert summary["iterations"] == 2
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] == r["loss"] for r in records)
    # iteration 1 samples with the weights iteration 0 trained (both towers, moved into vLLM in place)
    assert records[1]["logprob_diff_mean"] <= 1e-5, records[1]["logprob_diff_mean"]
    final = tmp_path / "run" / "final"
    model = AutoModelForImageTextToText.from_pretrained(final)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert AutoProcessor.from_pretrained(final).image_token == "<|image_pad|>"
    start = load_file(str(prepare_model(parse_config(TINY)) / "model.safetensors"))
    trained = load_file(str(final / "model.safetensors"))
    moved = [k for k in start if not torch.equal(start[k], trained[k])]
    assert any("visual" in k for k in moved) and any("visual" not in k for k in moved)
    # vLLM serves final/ as it is: its greedy answers to held-out pictures are transformers' own
    from engines.inference.sampling import SamplingParams
    from engines.inference.vllm_engine import VllmEngine
    from engines.model.text.processor import VisionProcessor
    from rl.setup.vision_warmstart import greedy_responses, shapes_tasks

    tasks, vp = shapes_tasks(4, seed=11), VisionProcessor.load(final)
    want = greedy_responses(model, AutoProcessor.from_pretrained(final), tasks, max_new_tokens=12)
    engine = VllmEngine(final, [vp.tokenizer.eos_token_id], max_seq_len=256, max_num_seqs=4,
                        kv_cache_bytes=32 << 20, dtype="float32")
    try:
        outs = engine.generate([vp.render(t.messages) for t in tasks], SamplingParams(0.0, 12),
                               images=[t.images for t in tasks])
    finally:
        engine.close()
    got = [vp.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    assert got == want and any(got)
