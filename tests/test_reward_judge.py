"""An LLM judge as the reward (envs/reward_judge.py), against `rl serve`'s server of a tiny model trained here to grade
four responses (right ones 9, wrong ones 2); its score parse, and judge failures counted as errors, not rewards."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import uvicorn
from gymnasium.utils.env_checker import check_env

from checkpoint_engine.topology import free_port
from engines.inference.server import ServedModel, build_app
from engines.model.arch import ModelConfig
from engines.model.attention import padded_causal_mask, positions_from_valid
from engines.model.causal_lm import CausalLM
from engines.model.hf_io import save_pretrained
from engines.model.tokenizer import train_tokenizer
from envs import Task, make
from envs.base import AnyText
from envs.reward_judge import JudgeEnv, JudgeError, judge_prompt, parse_score

RUBRIC = "Is it right?"
TASKS = [Task("j1", "What is 2 + 3?", "5"), Task("j2", "What is 7 * 6?", "42")]
CASES = [(TASKS[0], "The answer is 5.", 9), (TASKS[0], "Sorry, no idea.", 2),
         (TASKS[1], "The answer is 42.", 9), (TASKS[1], "Sorry, no idea.", 2)]


def trained_judge(directory: Path) -> None:
    """A tiny model that replies ``Score: N`` (then EOS) to the judge prompts of CASES, saved to ``directory``."""
    texts = [judge_prompt(task, response, RUBRIC, 10) for task, response, _ in CASES]
    tok = train_tokenizer(texts * 3 + [f"Score: {i}" for i in range(11)], vocab_size=500)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]  # as the server renders
    targets = [[*tok.encode(f"Score: {score}"), tok.eos_id] for *_, score in CASES]
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    length = max(len(p) + len(t) for p, t in zip(prompts, targets, strict=True))
    ids = torch.full((len(CASES), length), tok.pad_id)
    labels = torch.full((len(CASES), length), -100)
    valid = torch.zeros(len(CASES), length, dtype=torch.bool)
    for i, (p, t) in enumerate(zip(prompts, targets, strict=True)):
        ids[i, :len(p) + len(t)] = torch.tensor(p + t)
        valid[i, :len(p) + len(t)] = True
        labels[i, len(p) - 1:len(p) + len(t) - 1] = torch.tensor(t)  # the reply only
    mask, positions = padded_causal_mask(valid), positions_from_valid(valid)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a shared machine
    try:
        for _ in range(400):
            loss = F.cross_entropy(model(ids, positions, mask).flatten(0, 1), labels.flatten(), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 0.02:
                break
    finally:
        torch.set_num_threads(threads)
    save_pretrained(model.eval(), tok, directory)


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    """`rl serve` of the trained judge: its server (``engines.inference.server``) on a thread, as
    tests/test_server.py runs it (a separate process would only add its start-up)."""
    directory = tmp_path_factory.mktemp("judge") / "judge"
    trained_judge(directory)
    served = ServedModel(directory, max_num_seqs=4, name="judge")
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(served), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not srv.started:
            assert time.time() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        served.loop.close()


def judge(url: str, max_tokens: int = 8) -> JudgeEnv:
    return make("judge", base_url=url, model="judge", rubric=RUBRIC, max_tokens=max_tokens)


def test_the_judge_rewards_through_the_served_model(judge_url):
    env = judge(judge_url)
    assert env.task_type == "judge" and not env.group_level
    for task, response, score in CASES:
        env.reset(options={"task": task})
        obs, reward, terminated, truncated, info = env.step(response)
        assert (obs, reward, terminated, truncated) == ("", score / 10, True, False)
        assert info == {"judge_score": float(score), "judge_reply": f"Score: {score}"}
        assert env.diagnostics["judge_s"] > 0


def test_a_reply_without_a_score_is_an_error_not_a_reward(judge_url):
    env = judge(judge_url, max_tokens=2)  # the reply is cut before its number
    env.reset(options={"task": TASKS[0]})
    with pytest.raises(JudgeError, match=r"on task j1 has no score from 0 to 10 \(a 'Score: N' line\): 'Score"):
        env.step("The answer is 5.")


def test_server_errors_are_judge_errors(judge_url):
    env = make("judge", base_url=judge_url, model="gpt-4", retries=3)
    with pytest.raises(JudgeError, match=r"answered 404: .*does not exist.*\(after 1 attempt\)"):
        env.score(TASKS[0], "5")  # a client error: not retried
    env = make("judge", base_url=f"http://127.0.0.1:{free_port()}/v1", model="judge", retries=1)
    with pytest.raises(JudgeError, match=r"cannot reach .*\(after 2 attempts\)"):
        env.score(TASKS[0], "5")


def test_check_env_passes(judge_url):
    env = judge(judge_url)
    env.tasks = TASKS
    # responses the tiny judge's 1024-token context holds (a real judge's holds the default 64 Ki characters)
    env.action_space = AnyText(64, min_length=0, charset=env.action_space.character_set)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env, skip_render_check=True)


@pytest.mark.parametrize(("reply", "score"), [
    ("Good.\nScore: 7", 7.0), ("**Score:** 8", 8.0), ("Final score = 6/10", 6.0), ('{"score": 3}', 3.0),
    ("Score: 4/5", 8.0), ("The score is 10.", 10.0), ("Score: 7.5", 7.5), ("Score: 3 at first.\nScore: 9", 9.0),
    ("SCORE: [5]", 5.0), ("Score: 11", None), ("Score: -1", None), ("Score: N", None), ("I like it.", None),
    ("scores: 7", None), ("Score: 3/0", None), ("", None),
])
def test_score_parse(reply, score):
    assert parse_score(reply, 10) == score
