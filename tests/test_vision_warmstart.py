"""The tiny vision-language warm start (``rl.setup.vision_warmstart``): a few SFT steps on shapes tasks lower the
loss, and the saved directory loads in transformers (``AutoModelForImageTextToText`` + ``AutoProcessor``) and in the
project's ``VisionProcessor``, with an image of a shapes task becoming ``(image_size / 28) ** 2`` image tokens."""

from __future__ import annotations

import json

import torch


def test_a_few_sft_steps_lower_the_loss_and_the_directory_loads(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from engines.model.hf.backend import load_hf_model
    from engines.model.text.processor import VisionProcessor
    from rl.setup.vision_warmstart import VisionWarmStart, build_vision_warm_start, shapes_tasks

    rows = []
    recipe = VisionWarmStart(steps=12, batch_size=8, lr=3e-3, num_examples=64, seed=0, image_size=56, eval_tasks=0,
                             hidden=64, heads=2, kv_heads=1, intermediate=128, vision_dim=64, vision_heads=2)
    target = build_vision_warm_start(tmp_path / "vw", recipe, progress=rows.append, log_every=1)
    losses = [r["loss"] for r in rows]
    assert len(losses) == 12 and all(v == v for v in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    info = json.loads((target / "vision_warmstart.json").read_text())
    assert info["recipe"]["steps"] == 12 and not (tmp_path / "vw.tmp").exists()

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
