"""The model's own chat and tool-call format (engines.model.text.chat_format, engines.model.text.conversation).

Tokenizers with the published chat templates of Qwen2.5, Qwen3, Llama 3.2 and Mistral v0.3
(tests/data/chat_templates; no hub) are built locally. A SWE episode played through the rollout
(``rl.rollout.multiturn.play_episodes``, scripted model turns written in the family's format, the real SWE environment
on the local sandbox) must be, token for token, ``apply_chat_template`` of its messages, and the calls the
model wrote must be parsed back (the task gets solved; the turns re-render as the template's ``tool_calls``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engines.model.text.chat_format import (
    FORMATS,
    ChatFormatError,
    Tool,
    ToolCall,
    detect_format,
    get_format,
)
from engines.model.text.conversation import Conversation
from engines.model.text.tokenizer import TextTokenizer, train_tokenizer
from envs.swe import TOOLS
from rl.config import parse_config
from rl.rollout.episodes import EpisodeRunner
from tests.test_multiturn import COUNTS, play_episodes
from tests.test_swe import calc_task


class Played:
    """One ended episode: its sample (tokens, reward, error, status) and its conversation (driver side)."""

    def __init__(self, sample, episode) -> None:
        self.sample, self.conv = sample, episode.conv
        self.prompt_ids, self.response_ids = sample.prompt_ids.tolist(), sample.response_ids.tolist()
        self.error, self.reward, self.truncated = sample.error, sample.reward, sample.status == "truncated"

    def __repr__(self) -> str:
        return f"Played(status={self.sample.status!r}, error={self.error!r}, reward={self.reward!r})"

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CORPUS = ["You are fixing an issue in the repository. def add(a, b): return a + b", "view_file edit_file submit "
          '{"name": "bash", "arguments": {"command": "ls"}} path calc.py old_str new_str tests pytest PASSED']
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
FAMILIES = {  # template file, special tokens, added (non-special) tokens, tokenizer kwargs
    "qwen2_5": ("qwen2_5.jinja", QWEN_SPECIAL, QWEN_ADDED, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "qwen3": ("qwen3.jinja", QWEN_SPECIAL, [*QWEN_ADDED, "<think>", "</think>"],
              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama3": ("llama3_2.jinja", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                  "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"], [],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "mistral": ("mistral_v0_3.jinja", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                       "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [],
                {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
}
EXPECTED_FORMAT = {"qwen2_5": "hermes", "qwen3": "hermes", "llama3": "llama3_json", "mistral": "mistral"}
# what the model writes before its calls (Qwen3's template opens the turn with "<think>\n")
PREAMBLE = {"qwen2_5": "Let me look.\n", "qwen3": "I should read calc.py first.\n</think>\n\n", "llama3": "",
            "mistral": "", "k2": "Let me look.\n"}


def family_tokenizer(family: str) -> TextTokenizer:
    """A byte-level BPE with the family's special tokens and its real chat template, built in memory."""
    template, special, added, kwargs = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs)
    hf.add_tokens(added)
    hf.chat_template = (TEMPLATES / template).read_text()
    return TextTokenizer(hf, source=template)


def tools_openai() -> list[dict]:
    return [t.to_openai() for t in TOOLS]


class ScriptedModel:
    """The one call the rollout phase makes of the cluster: turn k answers every episode with the k-th scripted
    response (token ids + EOS); the prompts of the first episode are kept."""

    def __init__(self, tok: TextTokenizer, responses: list[str]):
        self.tok, self.responses, self.prompts = tok, responses, []

    def rollout(self, samples, token_budget, on_worker=None, contexts=None):
        from rl.sample import TurnResult

        ids = [*self.tok.encode(self.responses[len(self.prompts)]), self.tok.eos_id]
        request = samples[0].turn_request()  # the whole context: its prompt for this turn
        self.prompts.append(request.tokens[:request.turn].tolist())
        return [TurnResult(s.key, ids, [-0.5] * len(ids), "stop") for s in samples], [COUNTS]


def agent_turns(family: str, fmt_name: str, bad_first: bool) -> list[str]:
    """The fix of ``calc_task`` as three calls (view, edit, submit), one per turn, in the family's format."""
    fmt = get_format(fmt_name)
    calls = [("view_file", {"path": "calc.py"}),
             ("edit_file", {"path": "calc.py", "old_str": "def add(a, b):\n    return a - b",
                            "new_str": "def add(a, b):\n    return a + b"}),
             ("submit", {})]
    turns = []
    if bad_first:  # a call the model got wrong: an error observation, not a crash
        turns.append(PREAMBLE[family] + fmt.render_calls([ToolCall(fmt.call_id("bash", 0), "bash", {})])
                     .replace('{}', '{"command": ', 1))
    for name, args in calls:
        turns.append(PREAMBLE[family] + fmt.render_calls([ToolCall(fmt.call_id(name, len(turns)), name, args)]))
    return turns


def play_swe(tok: TextTokenizer, responses: list[str], tmp_path):
    cfg = parse_config({"env": {"name": "swe"}, "rollout": {"samples_per_prompt": 2, "max_turns": 6,
                                                            "max_tokens": 256}})
    model = ScriptedModel(tok, responses)
    runner = EpisodeRunner(cfg)
    try:
        samples, stats, played = play_episodes(model, cfg, tok, runner, [(0, cfg.env, calc_task(tmp_path))],
                                               max_context=1 << 16)
    finally:
        runner.close()
    episodes = [Played(s, played.kept[s.key]) for s in played.ended]
    assert episodes[0].response_ids == episodes[1].response_ids
    return episodes[0], model, samples, stats


def check_episode_is_the_template(tok: TextTokenizer, episode, model: ScriptedModel) -> None:
    """Every generation prompt is apply_chat_template of the messages so far, and the whole episode is a
    prefix of the template's rendering of all its messages (only what follows the final EOS is left)."""
    conv: Conversation = episode.conv
    messages = conv.messages
    starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(starts) == len(model.prompts)
    for i, prompt in zip(starts, model.prompts, strict=True):
        assert prompt == tok.apply_chat_template(messages[:i], tools=tools_openai())
    seq = episode.prompt_ids + episode.response_ids
    full = tok.apply_chat_template(messages, tools=tools_openai(), add_generation_prompt=False)
    assert full[:len(seq)] == seq
    assert tok.hf.decode(full[len(seq):]).strip() == ""
    assert conv.inexact_turns == 0


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3", "mistral"])
def test_tool_format_detected_from_the_real_template(family):
    tok = family_tokenizer(family)
    assert detect_format(tok).name == EXPECTED_FORMAT[family]
    assert detect_format(tok, "k2").name == "k2"  # model.tool_format overrides
    with pytest.raises(ChatFormatError, match="unknown tool format 'xml'"):
        detect_format(tok, "xml")


def test_tool_format_default_tokenizer_is_k2_and_unknown_templates_are_refused():
    tok = train_tokenizer(CORPUS, 300)
    assert tok.has_chat_template and detect_format(tok).name == "k2"
    other = family_tokenizer("qwen2_5")
    other.hf.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatFormatError, match="set model.tool_format"):
        detect_format(other)
    assert set(FORMATS) >= {"k2", "hermes", "llama3_json", "mistral"}


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3", "mistral"])
def test_tool_format_calls_render_as_the_template_renders_tool_calls(family):
    """The text a format writes for a call is what the family's template writes for the same ``tool_calls``,
    and parses back to the same call."""
    tok = family_tokenizer(family)
    fmt = detect_format(tok)
    call = ToolCall(fmt.call_id("bash", 0), "bash", {"command": "ls -la \"dir\""})
    user = [{"role": "user", "content": "List the files."}]
    prompt = tok.hf.apply_chat_template(user, tools=tools_openai(), tokenize=False, add_generation_prompt=True)
    structured = {"role": "assistant", "content": PREAMBLE[family].rstrip("\n"), "tool_calls": [call.to_openai()]}
    result = {"role": "tool", "tool_call_id": call.id, "name": "bash", "content": "calc.py"}
    rendered = tok.hf.apply_chat_template([*user, structured, result], tools=tools_openai(), tokenize=False)
    assert rendered.startswith(prompt + PREAMBLE[family] + fmt.render_calls([call]))
    calls, errors = fmt.parse(PREAMBLE[family] + fmt.render_calls([call]), TOOLS)
    assert errors == [] and [(c.name, c.arguments) for c in calls] == [("bash", call.arguments)]


@pytest.mark.parametrize("fmt_name", ["hermes", "llama3_json", "mistral", "k2"])
def test_tool_format_parse_errors_are_reported_not_raised(fmt_name):
    fmt = get_format(fmt_name)
    good = fmt.render_calls([ToolCall(fmt.call_id("bash", 0), "bash", {"command": "ls"})])
    assert fmt.parse("I am done.", TOOLS) == ([], [])
    unknown = good.replace('"bash"', '"rm_rf"').replace("functions.bash", "functions.rm_rf")
    assert any("unknown tool 'rm_rf'" in e for e in fmt.parse(unknown, TOOLS)[1])
    broken = good.replace('{"command": "ls"}', '{"command": ')
    calls, errors = fmt.parse(broken, TOOLS)
    assert calls == [] and errors and "JSON" in " ".join(errors)
    schema = good.replace('{"command": "ls"}', '{"command": 3}')
    assert any("is not of type 'string'" in e for e in fmt.parse(schema, TOOLS)[1])


def test_swe_qwen2_5_episode_is_the_chat_template_and_calls_parse_back(tmp_path):
    tok = family_tokenizer("qwen2_5")
    episode, model, samples, stats = play_swe(tok, agent_turns("qwen2_5", "hermes", bad_first=True), tmp_path)
    assert episode.error is None and episode.reward == 1.0 and not episode.truncated, episode
    assert stats["multi_turn_template_errors"] == 0 and len(samples) == 2
    check_episode_is_the_template(tok, episode, model)
    conv = episode.conv
    assert "JSON" in conv.messages[2]["content"] and conv.messages[2]["role"] == "tool"  # the bad call's error
    called = [m["tool_calls"][0]["function"]["name"] for m in conv.messages if m.get("tool_calls")]
    assert called == ["view_file", "edit_file", "submit"]
    assert "<tools>" in tok.hf.decode(episode.prompt_ids) and "# Tools" in tok.hf.decode(episode.prompt_ids)


def test_swe_qwen3_thinking_turns_are_the_chat_template(tmp_path):
    tok = family_tokenizer("qwen3")
    episode, model, _, _ = play_swe(tok, agent_turns("qwen3", "hermes", bad_first=False), tmp_path)
    assert episode.error is None and episode.reward == 1.0, episode
    check_episode_is_the_template(tok, episode, model)
    assert tok.hf.decode(model.prompts[1]).count("<think>\nI should read calc.py first.\n</think>") == 1


def test_swe_llama3_episode_is_the_chat_template_and_calls_parse_back(tmp_path):
    tok = family_tokenizer("llama3")
    episode, model, _, stats = play_swe(tok, agent_turns("llama3", "llama3_json", bad_first=True), tmp_path)
    assert stats["multi_turn_template_errors"] == 0
    assert episode.error is None and episode.reward == 1.0, episode
    check_episode_is_the_template(tok, episode, model)
    called = [m["tool_calls"][0]["function"]["name"] for m in episode.conv.messages if m.get("tool_calls")]
    assert called == ["view_file", "edit_file", "submit"]
    assert "<|start_header_id|>ipython<|end_header_id|>" in tok.hf.decode(model.prompts[1])


def test_swe_mistral_episode_is_the_chat_template_and_calls_parse_back(tmp_path):
    tok = family_tokenizer("mistral")
    episode, model, _, _ = play_swe(tok, agent_turns("mistral", "mistral", bad_first=False), tmp_path)
    assert episode.error is None and episode.reward == 1.0, episode
    check_episode_is_the_template(tok, episode, model)
    assert "[TOOL_RESULTS]" in tok.hf.decode(model.prompts[1])


def test_swe_default_k2_episode_is_the_chat_template(tmp_path):
    tok = train_tokenizer(CORPUS, 300)
    episode, model, _, _ = play_swe(tok, agent_turns("k2", "k2", bad_first=True), tmp_path)
    assert episode.error is None and episode.reward == 1.0, episode
    check_episode_is_the_template(tok, episode, model)


def test_tool_format_template_that_trims_the_model_turn_keeps_its_tokens():
    """Llama 3 trims assistant content: a turn with trailing whitespace cannot re-render byte for byte, so the
    observation is taken after the template's own end of that turn and the model keeps its tokens."""
    tok = family_tokenizer("llama3")
    fmt = detect_format(tok)
    conv = Conversation(tok, [{"role": "user", "content": "List the files."}], tools_openai(), fmt)
    call = ToolCall(fmt.call_id("bash", 0), "bash", {"command": "ls"})
    ids = [*tok.encode(fmt.render_calls([call]) + "\n\n"), tok.eos_id]
    obs = conv.add_turn(ids, [{"role": "tool", "tool_call_id": call.id, "content": "calc.py"}], [call])
    assert conv.inexact_turns == 1
    assert tok.hf.decode(obs).startswith("<|start_header_id|>ipython<|end_header_id|>")
    assert tok.hf.decode(obs).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_tool_format_template_that_cannot_continue_raises_a_clear_error():
    """Mistral's template requires alternating user/assistant turns; two plain-text turns in a row break it."""
    tok = family_tokenizer("mistral")
    conv = Conversation(tok, [{"role": "user", "content": "Fix it."}], tools_openai(), detect_format(tok))
    conv.add_turn([*tok.encode("I will not call tools."), tok.eos_id],
                  [{"role": "tool", "tool_call_id": "call00000", "content": "No tool call found."}])
    with pytest.raises(ChatFormatError, match="cannot render turn 2"):
        conv.add_turn([*tok.encode("Still no tools."), tok.eos_id],
                      [{"role": "tool", "tool_call_id": "call00001", "content": "No tool call found."}])


def test_tool_objects_round_trip():
    tool = Tool.from_openai(TOOLS[0].to_openai())
    assert tool == TOOLS[0]
    assert ToolCall("call_0", "bash", {"command": "ls"}).to_openai()["function"]["arguments"] == {"command": "ls"}


def test_tool_format_constrained_decoding_for_hermes_and_a_clear_refusal_for_others():
    from engines.inference.constrained import CONSTRAINED_FORMATS, ConstraintCompiler

    tok = train_tokenizer(CORPUS, 300)
    compiler = ConstraintCompiler(tok)
    fmt = get_format("hermes")
    text = fmt.render_calls([ToolCall("call_0", "bash", {"command": "ls"}), ToolCall("call_1", "submit", {})])
    for choice, prefix in (("required", ""), ("auto", "Let me look.\n")):
        m = compiler.tool_calls(TOOLS, tool_choice=choice, tool_format="hermes").matcher()
        assert m.accept_text(prefix + text) and m.accept(tok.eos_id) and m.is_terminated()
    m = compiler.tool_calls(TOOLS, tool_format="hermes").matcher()
    assert not m.accept_text('<tool_call>\n{"name": "rm_rf"')
    assert CONSTRAINED_FORMATS == ("k2", "hermes")
    with pytest.raises(ValueError, match="available for the formats k2, hermes, not 'mistral'"):
        compiler.tool_calls(TOOLS, tool_format="mistral")
