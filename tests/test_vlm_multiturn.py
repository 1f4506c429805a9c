"""Multi-turn episodes whose observations show images (rl.rollout.multiturn, rl.algo.update.expand_images).

An environment returns the images of an observation in ``info["images"]``, one per ``{"type": "image"}`` part of
its observation messages. The sample's images grow with the conversation: the rollout engine gets them all with
each turn, and the trainer expands each observation image's placeholder where it stands, so that what it scores is
the conversation the processor itself makes of the whole text and every image."""

from __future__ import annotations

import json

import numpy as np
import torch

from engines.model.images import ImageRef
from envs import Env, Task, register
from envs.visual import ShapesEnv
from tests.test_vision_warmstart import TINY

AGAIN = "And in this picture? End your reply with \"The answer is N.\" where N is the number."


class CountTwice(Env):
    """Turn 1: the task's picture and question; turn 2: another picture (an observation with an image), graded on
    how many shapes that one holds."""

    task_type = "count-twice"
    multi_turn = True

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        self.turn = 0
        info["messages"], info["images"] = self.task.messages, list(self.task.images)
        return obs, info

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            second = ImageRef.of(self.task.meta["second_image"])
            message = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": AGAIN}]}
            return AGAIN, 0.0, False, False, {"messages": [message], "images": [second]}
        return "", ShapesEnv().score(self.task, action)[0], True, False, {}

    @classmethod
    def generate_tasks(cls, n, seed):
        first, second = ShapesEnv.generate_tasks(n, seed), ShapesEnv.generate_tasks(n, seed + 1)
        return [Task(f"twice-{i}", a.prompt, b.answer, {"second_image": b.images[0].data}, messages=a.messages,
                     images=a.images) for i, (a, b) in enumerate(zip(first, second, strict=True))]


register("count-twice-test", CountTwice)


def _warm_start():
    from rl.config import parse_config
    from rl.setup.warmstart import prepare_model

    return prepare_model(parse_config(TINY))  # test_vision_warmstart's (the session's cache)


def _two_turns(vp, task, turn1):
    """(prompt, response, loss mask, log-probs) of a conversation: ``turn1``, the observation with the second
    picture, a second turn."""
    eos = vp.tokenizer.convert_tokens_to_ids("<|im_end|>")
    obs = vp.render([{"role": "assistant", "content": "x"}, {"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": AGAIN}]}])
    obs = obs[obs.index(eos) + 1:]  # what the template adds after the model's turn
    turn2 = [*vp.tokenizer.encode(" The answer is 2.", add_special_tokens=False), eos]
    mask = [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    logprobs = [-0.5 - 0.01 * i if m else 0.0 for i, m in enumerate(mask)]
    return vp.render(task.messages), turn1 + obs + turn2, mask, logprobs


def test_the_trainer_reads_a_conversation_with_observation_images_as_the_processor_does():
    """A sample of two turns, the second after an observation with an image: expanded for the trainer, it is
    exactly the processor's own expansion of the conversation's text with its two images, and the response's loss
    mask and log-probs follow their tokens (0 on the observation's image tokens). A placeholder token the policy
    sampled stays one text token (type 0), and the images stay where they are."""
    from transformers import AutoProcessor

    from engines.model.text.processor import VisionProcessor
    from rl.algo.update import expand_images
    from tests.conftest import make_sample

    model_dir = _warm_start()
    vp, hf = VisionProcessor.load(model_dir), AutoProcessor.from_pretrained(model_dir)
    task = CountTwice.generate_tasks(1, 0)[0]
    second = ImageRef.of(task.meta["second_image"])
    eos = vp.tokenizer.convert_tokens_to_ids("<|im_end|>")

    class Engine:
        processor = vp

    def expanded(turn1):
        prompt, response, mask, logprobs = _two_turns(vp, task, turn1)
        s = make_sample(0, prompt, response, logprobs, 1.0)
        s.loss_mask, s.images = np.asarray(mask, dtype=bool), (*task.images, second)
        (got_prompt,), (doc,), (turns,) = expand_images(Engine, [s])
        return prompt + response, mask, logprobs, got_prompt, doc, turns

    turn1 = [*vp.tokenizer.encode(" I see two.", add_special_tokens=False), eos]
    ids, mask, logprobs, got_prompt, doc, turns = expanded(turn1)
    want = hf(text=[vp.tokenizer.decode(ids, skip_special_tokens=False)],
              images=[task.images[0].load(), second.load()], return_tensors="pt")
    assert got_prompt + turns.response_ids == want["input_ids"][0].tolist()
    assert all(torch.equal(doc.tensors[k], want[k]) for k in doc.tensors)
    assert doc.mm_token_type_ids == want["mm_token_type_ids"][0].tolist() and sum(doc.mm_token_type_ids) == 2 * 4
    assert len(turns.loss_mask) == len(turns.logprobs) == len(turns.response_ids)
    assert turns.loss_mask.sum() == sum(mask) and np.isclose(turns.logprobs.sum(), sum(logprobs))
    assert list(turns.response_ids[:len(turn1)]) == turn1
    assert list(turns.logprobs[:len(turn1)]) == logprobs[:len(turn1)]
    # the model's own tokens keep their log-probs, in order
    assert [float(x) for x, m in zip(turns.logprobs, turns.loss_mask, strict=True) if m] == \
        [x for x, m in zip(logprobs, mask, strict=True) if m]

    sampled = [*turn1[:-1], vp.image_token_id, eos]  # the policy sampled a placeholder token: text
    _, _, _, prompt2, doc2, turns2 = expanded(sampled)
    at = len(prompt2) + len(sampled) - 2
    assert (prompt2 + turns2.response_ids)[at] == vp.image_token_id and doc2.mm_token_type_ids[at] == 0
    assert sum(doc2.mm_token_type_ids) == 2 * 4 and len(turns2.response_ids) == len(turns.response_ids) + 1
    assert all(torch.equal(doc2.tensors[k], doc.tensors[k]) for k in doc.tensors)


def test_a_run_of_episodes_with_observation_images_trains_on_what_vllm_sampled(ray_cluster, tmp_path):
    """``rl train`` on the two-picture environment: vLLM samples each second turn with both pictures, the trainer
    expands the observation's picture where it stands, and after the in-place update vLLM's log-probs of what it
    samples equal the trainer's (fp32) — a second picture read as text, or missing, would put them far apart."""
    from rl.api import train

    if not __import__("engines.inference.vllm_engine", fromlist=["x"]).vllm_available():
        import pytest

        pytest.skip("vLLM is not installed here (make setup installs it)")
    cfg = {"model": {"path": str(_warm_start())}, "env": {"name": "count-twice-test", "num_train": 32, "num_eval": 4},
           "run": {"iterations": 2, "eval_every": 2, "save_every": 2},
           "rollout": {"prompts_per_iteration": 4, "samples_per_prompt": 4, "max_tokens": 40, "max_turns": 2,
                       "max_batch": 16, "kv_cache_mb": 64},
           "algorithm": {"drop_equal_reward_groups": False, "minibatches": 1}, "optimizer": {"lr": 1e-2},
           "checkpoint_engine": {"bucket_mb": 0.01}}
    summary = train(cfg, tmp_path / "run")
    assert summary["iterations"] == 2
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["env_errors"] == 0 and r["trained_samples"] == 16 for r in records), records
    # every episode went on after the observation with the second picture
    assert all(r["multi_turn_turns"] == 2.0 and r["multi_turn_errors"] == 0 for r in records), records
    assert records[0]["grad_norm"] > 0  # trained: iteration 1 samples with updated weights
    assert records[1]["logprob_diff_mean"] <= 1e-5, records[1]["logprob_diff_mean"]
