"""Vision-language models on the transformers backend and vLLM: prompts with images from the model's own processor,
packed rows with images scored exactly as transformers' own forward scores each prompt alone, and vLLM's log-probs
after an in-place update (the vision tower's weights included) equal to the trainer's.

The references are transformers' own: ``processor(text=..., images=...)`` for the expanded prompt and its tensors,
and the model's own ``forward`` on that prompt (float32, SDPA) for the log-probs, never the code under test.
"""

from __future__ import annotations

import pytest
import torch

from engines.model.hf.backend import load_hf_model
from engines.model.hf.vision import DocumentMedia, pack_media
from engines.model.images import ImageRef
from engines.model.layout import hub_state
from engines.model.text.processor import VisionProcessor, VisionPromptError
from engines.model.text.tokenizer import TextTokenizer
from engines.training.packing import pack
from envs.base import Task
from tests.vlm_families import IMAGE_SIZES, save_tiny_vlm

#: families with each kind of layout: M-RoPE grids (Qwen2-VL), windowed tower attention (Qwen2.5-VL), interleaved
#: M-RoPE with deep-stack features (Qwen3-VL, and its MoE language model), image splitting into tiles with a
#: pixel-shuffle connector (SmolVLM), a CLIP tower with a projector (LLaVA), any-resolution tiles (LLaVA-NeXT), GLM's
#: M-RoPE (GLM-4.1V)
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "smolvlm", "llava", "glm4v", "llava_next", "qwen3_vl_moe"]
#: those whose in-place updates vLLM's CPU build takes and then serves as the trainer scores. Left out, each with its
#: cause (docs/vision.md): SmolVLM (its connector reads every image token id, a sampled one too), GLM-4.1V (an update
#: leaves 0.3 of log-prob between vLLM and the trainer), Qwen3-VL-MoE (vLLM's reload refuses its fused experts)
SERVED = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next"]
#: float32 on both sides: the same numbers to rounding
EXACT = 1e-5


def images(seed: int = 0, n: int = 3):
    """Deterministic random RGB images (PIL), of the families' test sizes."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return [Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for h, w in
            (IMAGE_SIZES * n)[:n]]


#: (content parts, how many images): two images around text, plain text, one image after text
PROMPTS = [([{"type": "image"}, {"type": "text", "text": "Question: how many?"}, {"type": "image"}], 2),
           ([{"type": "text", "text": "Q: 1+2="}], 0),
           ([{"type": "text", "text": "Look"}, {"type": "image"}], 1)]


@pytest.fixture(scope="module", params=FAMILIES)
def vlm_dir(request, tmp_path_factory):
    return save_tiny_vlm(request.param, tmp_path_factory.mktemp(request.param))


def _conversations():
    pics = iter(images())
    return [([{"role": "user", "content": content}], [next(pics) for _ in range(n)]) for content, n in PROMPTS]


def test_placeholders_expand_as_the_models_processor_does(vlm_dir):
    vp = VisionProcessor.load(vlm_dir)
    for messages, pics in _conversations():
        raw = vp.render(messages)
        got = vp.expand(raw, pics)
        text = vp.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ref = vp.hf(text=[text], images=pics or None, return_tensors="pt", return_mm_token_type_ids=True)
        assert got.ids == ref["input_ids"][0].tolist()
        assert got.mm_token_type_ids == ref["mm_token_type_ids"][0].tolist()
        assert sorted(got.media) == sorted(k for k in ref if k not in ("input_ids", "attention_mask",
                                                                       "mm_token_type_ids"))
        assert all(torch.equal(v, ref[k]) for k, v in got.media.items())
        # the count a context check uses, from the images' headers, is the expansion's
        refs = [ImageRef.of(p) for p in pics]
        assert vp.expanded_length(raw, refs) == len(got.ids) and vp.placeholders(raw) == len(pics)


def test_bad_image_prompts_are_refused_in_one_line(vlm_dir, tmp_path):
    vp = VisionProcessor.load(vlm_dir)
    raw = vp.render([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]}])
    with pytest.raises(VisionPromptError, match=r"task t1: the prompt has 1 image placeholder\(s\) but 2 image"):
        vp.expand(raw, images(n=2), "task t1")
    vp.max_images = 1
    with pytest.raises(VisionPromptError, match="more than the model's limit of 1"):
        vp.check([vp.image_token_id] * 2, images(n=2), "task t2")
    # an image prompt to a text-only model's tokenizer
    from tests.vllm_check import project_tokenizer

    text_only = project_tokenizer()
    task = Task("t3", "Q", "1", messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                          "text": "Q"}]}],
                images=(ImageRef.of(images(n=1)[0]),))
    with pytest.raises(VisionPromptError, match="task t3 has images, but .* text-only model's tokenizer"):
        text_only.prompt_ids(task)
    # the model's own tokenizer renders it through the processor
    tok = TextTokenizer.load(vlm_dir)
    assert tok.processor is not None and tok.prompt_ids(task) == raw


def test_packed_rows_with_images_score_as_transformers_does_each_prompt(vlm_dir):
    vp, model = VisionProcessor.load(vlm_dir), load_hf_model(vlm_dir)
    g = torch.Generator().manual_seed(0)
    convs = _conversations()
    prompts, media, responses = [], [], []
    for messages, pics in convs:
        e = vp.expand(vp.render(messages), pics)
        prompts.append(e.ids)
        media.append(DocumentMedia(e.media, e.mm_token_type_ids) if pics else None)
        responses.append(torch.randint(10, 390, (7,), generator=g).tolist())
    # rows as wide as the two prompts with images together: they share a row (first fit, longest first), so the
    # images of two documents meet in one row after a document's text; the text-only prompt has a row of its own
    batch = pack(prompts, responses, 0, "sdpa", width=len(prompts[0]) + len(prompts[2]) + 14)
    assert batch.ids.shape[0] == 2 and set(batch.mask.doc[0].tolist()) == {0, 2}
    with torch.no_grad():
        lp, _ = model(batch.ids, batch.positions, batch.mask, select=batch.target_flat, targets=batch.targets,
                      inv_temp=1 / 0.7, media=pack_media(batch.mask, media))
    got = batch.per_sequence(lp)
    hf = model.hf_model
    hf.set_attn_implementation({"": "sdpa", "text_config": "sdpa", "vision_config": "sdpa"})
    for i, (messages, pics) in enumerate(convs):
        text = vp.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        enc = vp.hf(text=[text], images=pics or None, return_tensors="pt", return_mm_token_type_ids=True)
        n = enc["input_ids"].shape[1]
        ids = torch.cat([enc["input_ids"], torch.tensor([responses[i]])], 1)
        kw = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        kw["mm_token_type_ids"] = torch.nn.functional.pad(kw["mm_token_type_ids"], (0, len(responses[i])))
        if hasattr(hf.model, "rope_deltas"):
            hf.model.rope_deltas = None  # no cache: positions from these inputs alone
        with torch.no_grad():
            logits = hf(input_ids=ids, **kw).logits[0].float() / 0.7
        want = torch.log_softmax(logits, -1)[n - 1:-1].gather(1, torch.tensor(responses[i])[:, None])[:, 0]
        assert float((want - got[i, :len(responses[i])]).abs().max()) < EXACT, i


def _trainer_logprobs(model, vp, convs, raws, responses, temperature):
    prompts, media = [], []
    for raw, (_, pics) in zip(raws, convs, strict=True):
        e = vp.expand(raw, pics)
        prompts.append(e.ids)
        media.append(DocumentMedia(e.media, e.mm_token_type_ids) if pics else None)
    batch = pack(prompts, responses, 0, "sdpa")
    with torch.no_grad():
        lp, _ = model(batch.ids, batch.positions, batch.mask, select=batch.target_flat, targets=batch.targets,
                      inv_temp=1 / temperature, media=pack_media(batch.mask, media))
    per = batch.per_sequence(lp)
    return [per[i, :len(r)] for i, r in enumerate(responses)]


@pytest.mark.skipif(not __import__("engines.inference.vllm_engine", fromlist=["x"]).vllm_available(),
                    reason="vLLM is not installed here (make setup installs it)")
@pytest.mark.parametrize("family", SERVED)
def test_vllm_samples_images_and_takes_in_place_updates_of_both_towers(family, tmp_path):
    """vLLM's CPU build samples prompts with images (template ids + the images, which it expands itself) with the
    log-probs the trainer computes; after an in-place update of every weight, and after one of the vision tower
    alone, it still does, on the same images (its encoder cache would otherwise serve the old tower's features)."""
    from engines.inference.sampling import SamplingParams
    from engines.inference.vllm_engine import VllmEngine

    vlm_dir = save_tiny_vlm(family, tmp_path / family)
    vp, model = VisionProcessor.load(vlm_dir), load_hf_model(vlm_dir)
    convs = _conversations()
    raws = [vp.render(m) for m, _ in convs]
    engine = VllmEngine(vlm_dir, [vp.tokenizer.eos_token_id], max_seq_len=256, max_num_seqs=4,
                        kv_cache_bytes=64 << 20, dtype="float32")
    temperature = 0.8

    def sample(round_: int):
        for i, (raw, (_, pics)) in enumerate(zip(raws, convs, strict=True)):
            engine.add_request(raw, SamplingParams(temperature, 10, seed=10 * round_ + i, ignore_eos=True),
                               images=[ImageRef.of(p) for p in pics], request_id=i)
        got = {}
        while engine.has_unfinished():
            got.update({c.request_id: c for c in engine.step()})
        return [got[i] for i in range(len(convs))]

    def check(outs, tag):
        want = _trainer_logprobs(model, vp, convs, raws, [list(c.token_ids) for c in outs], temperature)
        for c, w in zip(outs, want, strict=True):
            assert len(c.token_ids) == 10
            assert float((torch.tensor(c.logprobs) - w).abs().max()) < EXACT, tag

    try:
        before = sample(0)
        check(before, "start-up weights")
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        engine.load_weights(iter(hub_state(model).items()), version=1)
        check(sample(0), "every weight updated")
        # the vision tower alone: the same images now read differently, the text-only prompt does not change
        from engines.model.hf.spec import vision_modules

        side = {id(p) for m in vision_modules(model) for p in m.parameters()}
        tower = [n for n, p in model.named_parameters() if id(p) in side]
        assert tower and len(tower) < len(list(model.parameters()))
        old = sample(1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in tower:
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
        engine.load_weights(iter(hub_state(model).items()), version=2)
        new = sample(1)
        check(new, "vision tower updated")
        assert new[1].token_ids == old[1].token_ids and new[1].logprobs == old[1].logprobs
        assert any(a.logprobs != b.logprobs for a, b in zip((new[0], new[2]), (old[0], old[2]), strict=True))
    finally:
        engine.close()


# slow tier: make test has the rl train path of a VLM (test_vision_warmstart), both towers updated in place per family
# (above) and several images per sample through the trainer (test_vlm_multiturn); this adds qwen2_5_vl on Ray, 58 s
@pytest.mark.slow
def test_a_run_trains_on_image_samples_and_vllm_serves_the_trained_towers(ray_cluster, tmp_path):
    """The whole path with real Ray workers (``rl.loop.cluster.Cluster`` as ``rl train`` builds it): vLLM samples
    prompts with images, the trainer takes a K1.5 step on them (expanding each sample's placeholders with the
    model's processor), the checkpoint engine updates vLLM in place, and what vLLM then samples is scored by the
    trained weights (transformers' own loader) to rounding. The saved model loads as an image-text-to-text model
    with its processor."""
    import ray
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from engines.inference.sampling import SamplingParams
    from rl.config import parse_config
    from rl.loop.cluster import Cluster
    from rl.settings import for_model
    from tests.conftest import make_sample, train_on

    if not __import__("engines.inference.vllm_engine", fromlist=["x"]).vllm_available():
        pytest.skip("vLLM is not installed here (make setup installs it)")
    model_dir = save_tiny_vlm("qwen2_5_vl", tmp_path / "model")
    vp = VisionProcessor.load(model_dir)
    cfg = parse_config({"model": {"path": str(model_dir), "backend": "transformers"},
                        "rollout": {"engine": "vllm", "kv_cache_mb": 64, "max_seq_len": 256, "max_batch": 8},
                        "algorithm": {"minibatches": 1, "micro_batch": 8}, "optimizer": {"lr": 1e-2},
                        "checkpoint_engine": {"bucket_mb": 0.01}})
    settings = for_model(cfg, str(model_dir))
    convs = _conversations()
    raws = [vp.render(m) for m, _ in convs]
    pics = [tuple(ImageRef.of(p) for p in ps) for _, ps in convs]
    sampling = [SamplingParams(1.0, 10, seed=10 + i, ignore_eos=True) for i in range(len(raws))]
    with Cluster(settings, str(model_dir)) as cluster:
        start = ray.get(cluster.trainers[0].state_dict.remote())
        outs = cluster.rollouts.generate(raws, sampling, seed=0, images=list(pics))
        cluster.trainers.offload()
        cluster.rollouts.sleep()
        cluster.trainers.onload()
        samples = [make_sample(i, o.prompt_ids, o.token_ids, o.logprobs, float(i % 2)) for i, o in enumerate(outs)]
        samples += [make_sample(i, o.prompt_ids, o.token_ids[:5], o.logprobs[:5], float(1 - i % 2))
                    for i, o in enumerate(outs)]  # each prompt's group: two responses with different rewards
        for s in samples:
            s.images = pics[s.group]
        metrics = train_on(cluster, samples)
        cluster.trainers.offload()
        trained = ray.get(cluster.trainers[0].state_dict.remote())
        cluster.rollouts.wake()
        cluster.rollouts.update_weights()
        after = cluster.rollouts.generate(raws, sampling, seed=0, images=list(pics))
    assert metrics and all(m["loss"] == m["loss"] for m in metrics)
    # both towers trained (the checkpoint's names: the language model's as transformers' reverse conversion writes
    # them, the legacy model.layers.* of Qwen2.5-VL, which transformers and vLLM both load)
    moved = [k for k in trained if not torch.equal(trained[k], start[k])]
    assert any(k.startswith("visual.") or ".visual." in k for k in moved)
    assert any(".layers." in k and "visual" not in k for k in moved)
    # transformers' own loader on the trained weights scores what vLLM sampled after the update
    trained_dir = tmp_path / "trained"
    trained_dir.mkdir()
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (trained_dir / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in trained.items()}, trained_dir / "model.safetensors")
    model = load_hf_model(trained_dir)
    want = _trainer_logprobs(model, vp, convs, raws, [list(c.token_ids) for c in after], 1.0)
    for c, w in zip(after, want, strict=True):
        assert float((torch.tensor(c.logprobs) - w).abs().max()) < EXACT
    assert isinstance(AutoModelForImageTextToText.from_pretrained(trained_dir), torch.nn.Module)
    assert AutoProcessor.from_pretrained(trained_dir).image_token == vp.image_token


@pytest.mark.parametrize("freeze", [False, True])
def test_muon_takes_the_language_model_and_freeze_vision_keeps_the_tower(freeze, tmp_path):
    """Muon for the language model's matrices, AdamW for the vision side (role ``vision``); one training step on a
    batch with images moves the tower unless ``model.freeze_vision``, and the language model either way."""
    from engines.model.hf.backend import read_hf_config
    from engines.training.engine import TrainingEngine
    from engines.training.optim import build_optimizers
    from engines.training.parallel_dims import ParallelDims
    from engines.training.param_roles import param_roles
    from engines.training.policy import PolicySpec, build_policy

    model_dir = save_tiny_vlm("qwen2_vl", tmp_path / "m")
    model = build_policy(read_hf_config(model_dir), PolicySpec(backend="transformers", freeze_vision=freeze),
                         ParallelDims(workers=1), "cpu")
    model.load_state_dict(load_hf_model(model_dir).state_dict())
    roles = param_roles(model)
    tower = {n for n in roles if ".visual." in n}
    assert tower and all(roles[n] == "vision" for n in tower)
    assert {roles[n] for n in roles if ".language_model.layers." in n and n.endswith("proj.weight")} == {"matrix"}
    engine = TrainingEngine(model, build_optimizers(model, "muon", 1e-2, 0.0), 0)
    engine.processor = VisionProcessor.load(model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (messages, pics), *_ = _conversations()
    e = engine.processor.expand(engine.processor.render(messages), pics)
    host = pack([e.ids], [[7, 8, 9]], 0, "sdpa")
    scores = engine.score_packed(host, torch.ones(3), pack_media(host.mask, [DocumentMedia(e.media,
                                                                                         e.mm_token_type_ids)]))
    (-scores.logprobs.sum()).backward()
    engine.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any(".language_model.layers." in n for n in moved)
    assert bool(moved & tower) is not freeze


def test_the_server_answers_openai_image_content_parts(tmp_path):
    """``rl serve`` on a vision-language model (vLLM): the official ``openai`` client sends an image as a base64 data
    URL in a content part; the answer's log-probs are the trainer's for that prompt and image. A bad image and an
    image to a text-only model are one-line 400s."""
    import base64
    import io

    import openai

    from engines.inference.server import ServedModel
    from tests.test_server import running

    if not __import__("engines.inference.vllm_engine", fromlist=["x"]).vllm_available():
        pytest.skip("vLLM is not installed here (make setup installs it)")
    model_dir = save_tiny_vlm("qwen2_vl", tmp_path / "m")
    pic = images(n=1)[0]
    buf = io.BytesIO()
    pic.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Look"}]
    with running(ServedModel(model_dir, max_num_seqs=4, kv_cache_bytes=32 << 20, engine="vllm")) as (client, _):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                           max_tokens=8, temperature=0, logprobs=True)
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[0\]: the image does not decode"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], max_tokens=2)
    # the trainer's greedy continuation of the same prompt and image, token by token
    vp, model = VisionProcessor.load(model_dir), load_hf_model(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Look"}]}]
    raw, ids, want = vp.render(messages), [], []
    e = vp.expand(raw, [pic])
    for _ in range(8):
        batch = pack([e.ids], [[*ids, 0]], 0, "sdpa")  # the logits after the last token: its filler's target
        with torch.no_grad():
            logits = model(batch.ids, batch.positions, batch.mask, select=batch.target_flat[-1:],
                           media=pack_media(batch.mask, [DocumentMedia(e.media, e.mm_token_type_ids)]))
        best = int(logits[0].argmax())
        ids.append(best)
        want.append(float(torch.log_softmax(logits[0].float(), -1)[best]))
    assert r.choices[0].message.content == vp.tokenizer.decode(ids, skip_special_tokens=True)
    got = [t.logprob for t in r.choices[0].logprobs.content]
    assert got == pytest.approx(want, abs=1e-4)


def test_a_run_of_image_tasks_on_a_text_only_model_stops_in_one_line():
    from engines.model.text.tokenizer import train_tokenizer
    from rl.config import parse_config
    from rl.errors import UserError
    from rl.rollout.data import load_task_sets, rollout_seq_len

    cfg = parse_config({"env": {"name": "shapes", "num_train": 8, "num_eval": 4}})
    sets = load_task_sets(cfg)
    assert all(len(t.images) == 1 for t in sets.train + sets.eval)
    tok = train_tokenizer([t.prompt for t in sets.train], vocab_size=300, style="chatml")
    with pytest.raises(UserError, match=r"^task shapes-\S+ has images, but tokenizer is a text-only model's "
                                        r"tokenizer \(no image processor beside it\)$"):
        rollout_seq_len(cfg, sets, tok, 512)
