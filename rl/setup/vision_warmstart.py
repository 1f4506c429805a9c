"""A tiny vision-language warm start: a Qwen2-VL-layout model trained from scratch by SFT on the ``shapes`` tasks.

The text warm start (``rl.setup.warmstart``) has a vision counterpart here, for RL on an environment with images:

* tokenizer: the project's byte-level BPE trained on the tasks' text (prompt + reference solution), with Qwen2-VL's
  special tokens (ChatML's ``<|im_start|>``/``<|im_end|>``, ``<|vision_start|>``, ``<|image_pad|>``, ...) and a
  ChatML template that renders each ``{"type": "image"}`` part as ``<|vision_start|><|image_pad|><|vision_end|>``;
* model: transformers' ``Qwen2VLForConditionalGeneration`` of a tiny ``Qwen2VLConfig`` (head_dim 32, which vLLM's
  CPU attention needs), randomly initialised by transformers, run by the transformers backend (``HFCausalLM``);
* processor: ``Qwen2VLProcessor`` whose image processor resizes every picture to ``image_size`` x ``image_size``
  pixels (min = max pixels), so a 56x56 shapes picture is a fixed grid of 14 px patches merged 2x2:
  ``(image_size / 28) ** 2`` image tokens (56 -> 4, 112 -> 16);
* SFT: ``TrainingEngine`` with Muon for the language model's matrices (AdamW for the rest, the vision tower
  included, as ``build_optimizers`` assigns roles), each step the token-mean NLL of the reference solutions + EOS
  given the prompt and its image (placeholders expanded by the processor, images packed with ``pack_media``);
* evaluation: greedy held-out accuracy on tasks of another seed, decoded by the trained model itself
  (transformers' ``generate``) and scored by the environment;
* save: ``save_pretrained`` of the model and the processor, a directory that ``AutoModelForImageTextToText`` +
  ``AutoProcessor``, the project's ``VisionProcessor`` and vLLM load.

``rl train`` builds it (``rl.setup.warmstart.prepare_model``) when ``model.path`` is null and the environment's tasks
carry images, with the recipe of the run's ``warmstart`` section (``from_config``); ``python -m
rl.setup.vision_warmstart TARGET [--steps ...]`` builds one with a held-out accuracy curve. ``DEFAULTS`` is
``configs/shapes.yaml``'s recipe (hidden 128, 4 layers, 4 heads of 32, a 1-block tower of width 128, 112 px images
= 16 image tokens, 200 steps of 32 at Muon lr 3e-3); on the ``shapes`` reference solutions (the shapes listed, then
the answer) its curve was 0.405 held-out greedy accuracy at 250 steps, 0.605 at 500, 0.685 at 750 (one seed, 2
cores, about 0.3 s a step). Trained on the bare answer, a 56 px model stayed at chance (about 0.24) for 1,600 steps.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engines.model.hf.backend import HFCausalLM, attention_choice, build_hf_model
from engines.model.hf.vision import DocumentMedia, pack_media
from engines.model.text.family_tokens import STYLES
from engines.model.text.processor import Expanded, VisionProcessor
from engines.model.text.tokenizer import TextTokenizer, train_tokenizer
from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers
from engines.training.packing import pack
from envs.base import Env, Task
from envs.visual import ShapesEnv
from rl.config.model import WarmStartConfig
from rl.seeds import derive, warmstart_seed

__all__ = ["QWEN_VL_STYLE", "VisionWarmStart", "build_vision_warm_start", "greedy_accuracy", "sft_step",
           "tiny_qwen2_vl"]

#: the seed of the held-out tasks the accuracy is measured on (the SFT tasks' comes from ``rl.seeds``)
HELD_OUT_SEED = 98765


QWEN_VL_STYLE = STYLES["qwen_vl"]


@dataclass(frozen=True)
class VisionWarmStart:
    """The recipe: SFT (``steps`` of ``batch_size`` tasks drawn from ``num_examples``, Muon at ``lr``), the
    model's sizes, the processor's ``image_size`` (pixels a side) and the held-out evaluation (``eval_tasks``)."""

    steps: int = 200
    batch_size: int = 32
    lr: float = 3e-3
    num_examples: int = 4000
    seed: int = 0
    image_size: int = 112
    vocab_size: int = 320
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    vision_depth: int = 1
    vision_dim: int = 128
    vision_heads: int = 4
    max_positions: int = 256
    eval_tasks: int = 200
    max_new_tokens: int = 48

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.hidden // self.heads != 32:
            raise ValueError(f"a vision-language warm start needs hidden_size / num_attention_heads = 32 (vLLM's CPU "
                             f"attention), got {self.hidden} / {self.heads}")
        if self.image_size % 28:
            raise ValueError(f"image_size {self.image_size}: a multiple of 28 (14 px patches merged 2x2)")


DEFAULTS = VisionWarmStart()


def shapes_tasks(n: int, seed: int) -> list[Task]:
    return ShapesEnv.generate_tasks(n, seed)


def from_config(ws: WarmStartConfig) -> VisionWarmStart:
    """The recipe of a run's ``warmstart`` section: its SFT settings, ``architecture``'s sizes for the language
    model and ``vision`` for the tower; no held-out evaluation (the run measures the warm start at its start)."""
    a, v = ws.architecture, ws.vision
    return VisionWarmStart(steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr, num_examples=ws.num_examples,
                           seed=ws.seed, image_size=v.image_size, vocab_size=ws.vocab_size, hidden=a.hidden_size,
                           layers=a.num_hidden_layers, heads=a.num_attention_heads, kv_heads=a.num_key_value_heads,
                           intermediate=a.intermediate_size, max_positions=a.max_position_embeddings,
                           vision_depth=v.depth, vision_dim=v.hidden_size, vision_heads=v.num_heads, eval_tasks=0)


def vision_tokenizer(tasks: Sequence[Task], vocab_size: int) -> TextTokenizer:
    """The project's BPE on the tasks' text (prompt + solution) with Qwen2-VL's special tokens and template."""
    return train_tokenizer((t.prompt + t.meta["solution"] for t in tasks), vocab_size, QWEN_VL_STYLE)


def tiny_qwen2_vl(tok: TextTokenizer, spec: VisionWarmStart = DEFAULTS):
    """(Qwen2VLConfig, Qwen2VLProcessor) of a tiny model over ``tok``'s vocabulary."""
    from transformers import Qwen2VLConfig, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    hf = tok.hf
    ids = {s: hf.convert_tokens_to_ids(s) for s in QWEN_VL_STYLE.specials}
    text = dict(hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
                num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                max_position_embeddings=spec.max_positions, vocab_size=len(hf), eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"],
                bos_token_id=None,
                # M-RoPE over (t, h, w): head_dim 32 -> 16 frequencies
                rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0})
    vis = dict(depth=spec.vision_depth, embed_dim=spec.vision_dim, hidden_size=spec.hidden,
               num_heads=spec.vision_heads, mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vis, tie_word_embeddings=False,
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    px = spec.image_size * spec.image_size  # every picture resized to image_size x image_size
    size = {"shortest_edge": px, "longest_edge": px}
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(size=size), tokenizer=hf,
                                 video_processor=Qwen2VLVideoProcessor(size=size), chat_template=hf.chat_template)
    return cfg, processor


def expand_tasks(vp: VisionProcessor, tasks: Sequence[Task]) -> list[Expanded]:
    """Each task's prompt (chat template + its image) as the model reads it."""
    return [vp.expand(vp.render(t.messages), t.images, t.id) for t in tasks]


def sft_step(engine: TrainingEngine, prompts: Sequence[Expanded], responses: Sequence[list[int]]) -> dict[str, float]:
    """One optimizer step of SFT on prompts with images: the token-mean NLL of ``responses`` (one packed pass)."""
    host = pack([p.ids for p in prompts], responses, engine.pad_id, engine.attention)
    media = pack_media(host.mask, [DocumentMedia(p.media, p.mm_token_type_ids) for p in prompts])
    if media is not None:
        media = media.to(engine.device)
    scores = engine.score_packed(host, torch.ones(host.target_seq.shape[0]), media)
    n_tokens = sum(len(r) for r in responses)
    loss = -scores.logprobs.sum() / n_tokens
    loss.backward()
    read = engine.reads.defer(loss.detach().double())
    grad_norm = engine.step()
    return {"loss": read.values[0], "grad_norm": grad_norm}


@contextmanager
def plain_attention(model: HFCausalLM):
    """Inside: the wrapped transformers model with SDPA everywhere (for ``generate``, which runs no packed rows)."""
    hf = model.hf_model
    hf.set_attn_implementation({"": "sdpa", "text_config": "sdpa", "vision_config": "sdpa"})
    try:
        yield hf
    finally:
        hf.set_attn_implementation(attention_choice(hf.config))


@torch.no_grad()
def greedy_responses(hf_model, processor, tasks: Sequence[Task], max_new_tokens: int = 10,
                     batch: int = 50) -> list[str]:
    """Greedy responses of a transformers vision-language model to ``tasks`` (their messages and images)."""
    tok = processor.tokenizer
    side, tok.padding_side = tok.padding_side, "left"
    out = []
    try:
        for i in range(0, len(tasks), batch):
            chunk = tasks[i:i + batch]
            texts = [processor.apply_chat_template(t.messages, add_generation_prompt=True, tokenize=False)
                     for t in chunk]
            enc = processor(text=texts, images=[t.images[0].load() for t in chunk], padding=True,
                            return_tensors="pt")
            if hasattr(getattr(hf_model, "model", None), "rope_deltas"):
                hf_model.model.rope_deltas = None
            gen = hf_model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            n = enc["input_ids"].shape[1]
            out += [tok.decode(g[n:], skip_special_tokens=True) for g in gen]
    finally:
        tok.padding_side = side
    return out


def score(env: Env, tasks: Sequence[Task], responses: Sequence[str]) -> float:
    return sum(env.score(t, r)[0] for t, r in zip(tasks, responses, strict=True)) / max(len(tasks), 1)


def greedy_accuracy(model: HFCausalLM, processor, env: Env, tasks: Sequence[Task], max_new_tokens: int = 48) -> float:
    """Held-out greedy accuracy of the trainer's model (decoded by transformers' ``generate`` on its weights)."""
    was = model.training
    with plain_attention(model) as hf:
        acc = score(env, tasks, greedy_responses(hf, processor, tasks, max_new_tokens))
    model.train(was)
    return acc


def build_vision_warm_start(target_dir: str | Path, spec: VisionWarmStart = DEFAULTS, *, env: Env | None = None,
                            tasks: Sequence[Task] | None = None, eval_every: int = 0, log_every: int = 25,
                            progress: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Train and save the tiny vision-language warm start of recipe ``spec`` in ``target_dir`` (replaced
    atomically); returns it. ``tasks`` (each with ``meta["solution"]``) are the SFT data, by default
    ``spec.num_examples`` of ``env``'s (by default ``shapes``); the held-out ones are ``env``'s of another seed.

    ``progress`` is called with a dict per logged step (every ``log_every``: ``step``, ``loss``, ``seconds``; and
    ``accuracy`` every ``eval_every`` steps and at the end; ``spec.eval_tasks`` 0 skips the evaluation). The recipe
    and the final held-out accuracy are written beside the weights (``vision_warmstart.json``)."""
    steps, batch_size, lr, seed = spec.steps, spec.batch_size, spec.lr, spec.seed
    started = time.perf_counter()
    torch.manual_seed(warmstart_seed(seed))
    rng = random.Random(warmstart_seed(seed))
    env = env if env is not None else ShapesEnv()
    if tasks is None:
        tasks = env.generate_tasks(spec.num_examples, derive("vision_warmstart_tasks", seed),
                                   **env.generate_options)
    held_out = env.generate_tasks(spec.eval_tasks, HELD_OUT_SEED, **env.generate_options) if spec.eval_tasks else []
    tok = vision_tokenizer(tasks, spec.vocab_size)
    cfg, processor = tiny_qwen2_vl(tok, spec)
    vp = VisionProcessor(processor, "vision warm start")
    model = build_hf_model(cfg)
    engine = TrainingEngine(model, build_optimizers(model, "muon", lr, 0.0), tok.pad_id)
    engine.processor = vp
    expanded: dict[int, Expanded] = {}  # each task's prompt, expanded when first drawn

    def prompt(i: int) -> Expanded:
        if i not in expanded:
            expanded[i] = vp.expand(vp.render(tasks[i].messages), tasks[i].images, tasks[i].id)
        return expanded[i]

    responses = [[*tok.encode(t.meta["solution"]), tok.eos_id] for t in tasks]
    log: list[dict[str, Any]] = []

    def report(step: int, loss: float, evaluate: bool) -> None:
        row: dict[str, Any] = {"step": step, "loss": round(loss, 4)}
        if evaluate and held_out:
            row["accuracy"] = greedy_accuracy(model, processor, env, held_out, spec.max_new_tokens)
        row["seconds"] = round(time.perf_counter() - started, 1)
        log.append(row)
        if progress is not None:
            progress(row)

    loss = float("nan")
    if eval_every and held_out:
        report(0, loss, True)
    for step in range(1, steps + 1):
        idx = rng.sample(range(len(tasks)), min(batch_size, len(tasks)))
        loss = sft_step(engine, [prompt(i) for i in idx], [responses[i] for i in idx])["loss"]
        evaluate = step == steps or (eval_every and step % eval_every == 0)
        if evaluate or step % log_every == 0:
            report(step, loss, bool(evaluate))
    target = Path(target_dir)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.hf_model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    final = next((r["accuracy"] for r in reversed(log) if "accuracy" in r), None)
    (tmp / "vision_warmstart.json").write_text(json.dumps(
        {"recipe": asdict(spec), "held_out_seed": HELD_OUT_SEED, "held_out_greedy_accuracy": final, "log": log},
        indent=2))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Build the tiny vision-language warm start on shapes, with a curve.")
    p.add_argument("target")
    p.add_argument("--eval-every", type=int, default=100)
    for name, value in asdict(DEFAULTS).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    a = vars(p.parse_args(argv))
    target, every = a.pop("target"), a.pop("eval_every")
    build_vision_warm_start(target, VisionWarmStart(**a), eval_every=every,
                            progress=lambda r: print(json.dumps(r), flush=True))


if __name__ == "__main__":
    main()
