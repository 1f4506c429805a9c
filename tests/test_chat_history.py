"""Chat templates that rewrite history (engines.model.text.conversation): the episode's token stream stays append-only.

Qwen3's published template (tests/data/chat_templates/qwen3.jinja) drops the reasoning of every assistant turn
before the latest user query: while the observations are tool results the model's thinking stays in the history,
and the first user message after them rewrites every earlier turn. The model must keep seeing (and be trained on)
exactly what it generated, with only each observation's text taken from the template. Played through the rollout
phase (``play_episodes``) with scripted model turns, as the SWE episodes of tests/test_chat_format.py.
"""

from __future__ import annotations

from engines.model.text.chat_format import ToolCall, get_format
from envs import Env, Task, register
from envs.swe import TOOLS
from rl.config import parse_config
from rl.rollout.episodes import EpisodeRunner
from tests.test_chat_format import ScriptedModel, family_tokenizer
from tests.test_multiturn import play_episodes

QUESTION = "What does calc.py do?"
FILE = "def add(a, b):\n    return a - b"
NUDGE = "Answer in one word."
THOUGHTS = ["I should read calc.py first.", "It subtracts where it should add.", "One word, then."]


class LookThenAnswer(Env):
    """Turn 1: the model calls view_file (a tool result comes back); turn 2: the user asks for a one-word
    answer; turn 3: the answer is graded."""

    task_type = "look"
    multi_turn = True
    uses_tools = True

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        self.turn = 0
        info["messages"] = [{"role": "user", "content": QUESTION}]
        info["tools"] = [t.to_openai() for t in TOOLS]
        return obs, info

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            calls, _ = self.tool_format.parse(action, TOOLS, 0)
            return FILE, 0.0, False, False, {"calls": calls, "messages": [
                {"role": "tool", "tool_call_id": calls[0].id, "name": calls[0].name, "content": FILE}]}
        if self.turn == 2:
            return NUDGE, 0.0, False, False, {}
        return "", float(action.strip().endswith("Subtracts.")), True, False, {}

    @classmethod
    def generate_tasks(cls, n, seed):
        return [Task(f"look-{i}", QUESTION, "subtracts") for i in range(n)]


register("look-then-answer-test", LookThenAnswer)


def test_a_template_that_drops_earlier_reasoning_keeps_the_models_tokens_and_appends_only_observations():
    tok = family_tokenizer("qwen3")
    fmt = get_format("hermes")
    call = ToolCall(fmt.call_id("view_file", 0), "view_file", {"path": "calc.py"})
    turns = [f"{THOUGHTS[0]}\n</think>\n\n{fmt.render_calls([call])}",  # the template opened "<think>\n"
             f"{THOUGHTS[1]}\n</think>\n\nIt subtracts.", f"{THOUGHTS[2]}\n</think>\n\nSubtracts."]
    cfg = parse_config({"env": {"name": "look-then-answer-test"},
                        "rollout": {"samples_per_prompt": 2, "max_turns": 4, "max_tokens": 256}})
    model, runner = ScriptedModel(tok, turns), EpisodeRunner(cfg)
    try:
        samples, stats, played = play_episodes(model, cfg, tok, runner,
                                               [(0, cfg.env, LookThenAnswer.generate_tasks(1, 0)[0])],
                                               max_context=1 << 16)
    finally:
        runner.close()
    s = played.ended[0]
    conv = played.kept[s.key].conv
    assert s.status == "finished" and s.reward == 1.0 and s.error is None, s
    assert stats["multi_turn_template_errors"] == 0 and len(samples) == 2
    # the template did rewrite the history: rendered now, turns 1 and 2 have lost their reasoning
    rendered = tok.hf.apply_chat_template(conv.messages, tools=[t.to_openai() for t in TOOLS], tokenize=False)
    assert THOUGHTS[0] not in rendered and THOUGHTS[1] not in rendered and THOUGHTS[2] in rendered
    assert conv.rewritten_turns == 1
    # append-only: each turn's prompt is the previous prompt + what the model generated + the observation, so the
    # model sees every token it generated (its reasoning included), and the last prompt is the whole episode
    # less the last turn
    eos = [tok.eos_id]
    gen = [tok.encode(t) + eos for t in turns]
    p = model.prompts
    assert p[0] == s.prompt_ids.tolist() == conv.prompt_ids
    for k in (1, 2):
        assert p[k][:len(p[k - 1]) + len(gen[k - 1])] == p[k - 1] + gen[k - 1]
    assert p[2] + gen[2] == s.prompt_ids.tolist() + s.response_ids.tolist()
    assert all(t in tok.hf.decode(p[2]) for t in THOUGHTS[:2])
    # each observation is what the template writes for it after a turn, in Qwen3's ChatML
    tool_obs = tok.hf.decode(p[1][len(p[0]) + len(gen[0]):])
    user_obs = tok.hf.decode(p[2][len(p[1]) + len(gen[1]):])
    assert tool_obs == f"\n<|im_start|>user\n<tool_response>\n{FILE}\n</tool_response><|im_end|>\n" \
                       "<|im_start|>assistant\n<think>\n"
    assert user_obs == f"\n<|im_start|>user\n{NUDGE}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    # trained on: the model's turns (loss mask 1), never the observations
    mask = s.loss_mask
    assert sum(mask) == sum(len(g) for g in gen) and len(mask) == len(s.response_ids)
