"""Tool calling in the K2 format (envs.tools) and constrained decoding of tool calls (engines.inference.constrained)."""

from __future__ import annotations

import json

import pytest

from engines.inference.constrained import ConstraintCompiler, tool_call_format
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.text.tokenizer import train_tokenizer
from envs.tools import (
    ARGUMENTS_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    Tool,
    ToolCall,
    call_id,
    parse_tool_calls,
    render_tool_calls,
    render_tool_declarations,
    render_tool_results,
    validate_arguments,
)
from tests.conftest import sharp_model, tiny_config

READ_SPEC = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read part of a file",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "maxLength": 6, "description": "File path"},
                "lines": {"type": "integer", "minimum": 0, "maximum": 50},
                "mode": {"enum": ["text", "bytes"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
            },
            "required": ["path", "mode"],
            "additionalProperties": False,
        },
    },
}
FINISH = Tool("finish", "End the episode", {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                             "required": ["ok"]})
READ = Tool.from_openai(READ_SPEC)
TOOLS = [READ, FINISH]


def test_openai_conversion_round_trip():
    assert READ.to_openai() == READ_SPEC
    assert Tool.from_openai(READ.to_openai()) == READ
    bare = Tool.from_openai({"type": "function", "function": {"name": "noop"}})
    assert bare.parameters == {"type": "object", "properties": {}} and bare.description == ""
    assert hash(READ) == hash(Tool.from_openai(READ_SPEC))
    with pytest.raises(ValueError):
        Tool.from_openai({"type": "retrieval"})


def test_declarations_follow_k2_template():
    text = render_tool_declarations(TOOLS)
    assert text.startswith("<|im_begin|>tool_declare<|im_middle|># Tools\nnamespace functions {")
    assert text.endswith("}<|im_end|>")
    assert "// Read part of a file\ntype read_file = (_: {" in text
    assert '  // File path\n  path: string,' in text and 'mode: "text" | "bytes"' in text
    assert "lines?: number" in text and "tags?: string[]" in text and "}) => any;" in text
    as_json = render_tool_declarations(TOOLS, language="json")
    assert json.loads(as_json.split("# Tools\n", 1)[1].removesuffix("<|im_end|>")) == [t.to_openai() for t in TOOLS]


@pytest.mark.parametrize("calls", [
    [ToolCall(call_id("read_file", 0), "read_file", {"path": "a.py", "mode": "text"})],
    [ToolCall(call_id("read_file", 3), "read_file", {"path": "é/ü", "mode": "bytes", "tags": ["日本", "x"]}),
     ToolCall(call_id("finish", 4), "finish", {"ok": True}),
     ToolCall(call_id("finish", 5), "finish", {"ok": False, "nested": {"a": [1, {"b": None}], "q": "\"\\\n"}})],
])
def test_calls_round_trip(calls):
    text = render_tool_calls(calls)
    assert text.startswith(SECTION_BEGIN + CALL_BEGIN + calls[0].id + ARGUMENTS_BEGIN)
    assert text.endswith(CALL_END + SECTION_END)
    parsed, errors = parse_tool_calls("Let me look.\n" + text)
    assert (parsed, errors) == (calls, [])
    assert render_tool_calls(parsed) == text


def test_results_render_one_message_per_call():
    a, b = ToolCall("functions.read_file:0", "read_file", {}), ToolCall("functions.finish:1", "finish", {})
    assert render_tool_results([(a, "x = 1"), (b, "done")]) == (
        "<|im_begin|>tool<|im_middle|>## Results of functions.read_file:0\nx = 1<|im_end|>"
        "<|im_begin|>tool<|im_middle|>## Results of functions.finish:1\ndone<|im_end|>")


def _call(cid: str, args: str) -> str:
    return f"{CALL_BEGIN}{cid}{ARGUMENTS_BEGIN}{args}{CALL_END}"


@pytest.mark.parametrize(("text", "expected"), [
    (SECTION_BEGIN + _call("functions.finish:0", '{"ok": true}'), "not closed"),
    (SECTION_BEGIN + SECTION_END, "empty"),
    (SECTION_BEGIN + "hi" + _call("functions.finish:0", '{"ok": true}') + SECTION_END, "unexpected text"),
    (SECTION_BEGIN + CALL_BEGIN + "functions.finish:0" + '{"ok": true}' + CALL_END + SECTION_END, "no <|tool_arg"),
    (SECTION_BEGIN + _call("finish", '{"ok": true}') + SECTION_END, "malformed call id"),
    (SECTION_BEGIN + _call("functions.finish:x", '{"ok": true}') + SECTION_END, "malformed call id"),
    (SECTION_BEGIN + _call("functions.delete:0", "{}") + SECTION_END, "unknown tool"),
    (SECTION_BEGIN + _call("functions.finish:0", '{"ok": tru') + SECTION_END, "not valid JSON"),
    (SECTION_BEGIN + _call("functions.finish:0", "[1]") + SECTION_END, "must be a JSON object"),
    (SECTION_BEGIN + _call("functions.finish:0", '{"ok": 1}') + SECTION_END, "is not of type 'boolean'"),
    (SECTION_BEGIN + _call("functions.read_file:0", '{"path": "a", "mode": "x"}') + SECTION_END, "is not one of"),
    (SECTION_BEGIN + _call("functions.read_file:0", '{"mode": "text"}') + SECTION_END, "'path' is a required"),
    (SECTION_BEGIN + _call("functions.finish:0", '{"ok": true}') * 2 + SECTION_END, "duplicate call id"),
])
def test_parse_reports_errors(text, expected):
    _, errors = parse_tool_calls(text, TOOLS)
    assert any(expected in e for e in errors), errors


def test_parse_keeps_good_calls_and_ignores_plain_text():
    good, bad = _call("functions.finish:0", '{"ok": true}'), _call("functions.finish:1", '{"ok": 2}')
    calls, errors = parse_tool_calls(SECTION_BEGIN + good + bad + SECTION_END, TOOLS)
    assert [c.id for c in calls] == ["functions.finish:0"] and len(errors) == 1 and "finish:1" in errors[0]
    assert parse_tool_calls("no tools needed", TOOLS) == ([], [])
    assert validate_arguments(READ, {"path": "abcdefg", "mode": "text", "lines": -1}) == [
        "lines: -1 is less than the minimum of 0", "path: 'abcdefg' is too long"]
    assert validate_arguments(Tool("t", "", {"type": 7}), {})[0].startswith("invalid schema")


# --- constrained decoding -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_tokenizer():
    # Trained on tool-call text so that markers and JSON take few tokens; byte-level, so any text encodes.
    corpus = [render_tool_declarations(TOOLS)] * 5 + [
        render_tool_calls([ToolCall(call_id("read_file", i), "read_file",
                                    {"path": f"f{i}.py", "lines": i, "mode": "text", "tags": ["a", "bc"]}),
                           ToolCall(call_id("finish", i + 1), "finish", {"ok": i % 2 == 0})])
        for i in range(40)] + ["What is 12 + 30? The answer is 42."] * 5
    tok = train_tokenizer(corpus, vocab_size=512)
    for text in [*corpus[:2], "é日本\t\x01{}[]\"\\"]:
        assert tok.decode(tok.encode(text)) == text
    return tok


@pytest.fixture(scope="module")
def setup(tool_tokenizer):
    # the model's vocabulary is wider than the tokenizer's (padded lm_head): the grammar must mask the extra ids
    vocab = tool_tokenizer.vocab_size + 7
    model = sharp_model(tiny_config(vocab, max_position_embeddings=512, eos_token_id=tool_tokenizer.eos_id,
                                    pad_token_id=tool_tokenizer.pad_id))
    engine = InferenceEngine(model, tool_tokenizer.eos_id, tool_tokenizer.pad_id, kv_cache_bytes=64 * 2**20)
    compiler = ConstraintCompiler(tool_tokenizer, vocab)
    prompt = tool_tokenizer.encode(render_tool_declarations(TOOLS) + "Read f1.py then finish.")
    return tool_tokenizer, engine, compiler, prompt


N = 24


def _outputs(setup, grammar, max_tokens=300):
    # up to 4 byte tokens per character of a random unicode string: room for 2 calls of the longest arguments
    _, engine, _, prompt = setup
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, grammar=grammar)
    return engine.generate([prompt] * N, params, seed=1)


def test_constrained_decoding_always_yields_valid_calls(setup):
    tok, _, compiler, _ = setup
    grammar = compiler.tool_calls(TOOLS, first_counter=2, max_calls=2)
    outs = _outputs(setup, grammar)
    names = set()
    for c in outs:
        text = tok.decode(c.token_ids)
        calls, errors = parse_tool_calls(text, TOOLS)
        assert errors == [] and 1 <= len(calls) <= 2, text
        assert [x.id.rsplit(":", 1)[1] for x in calls] == [str(2 + i) for i in range(len(calls))]
        assert text == render_tool_calls(calls)  # compact JSON in schema order: re-renders identically
        assert (c.finish_reason, c.stop_reason, c.token_ids[-1]) == ("stop", tok.eos_id, tok.eos_id)
        names |= {x.name for x in calls}
        # logprobs are those of the masked distribution: a token the grammar forces has probability 1
        m = grammar.matcher()
        for t, lp in zip(c.token_ids, c.logprobs, strict=True):
            forced = int(m.allowed_mask().sum()) == 1
            assert m.accept(t)
            assert not forced or abs(lp) < 1e-5
        assert m.is_terminated()
    assert names == {"read_file", "finish"}
    assert len({tuple(c.token_ids) for c in outs}) > N // 2  # really sampled, not one forced string

    # the same run without the grammar does not produce a single valid call
    free = _outputs(setup, None)
    valid = [parse_tool_calls(tok.decode(c.token_ids), TOOLS) for c in free]
    assert not any(calls and not errors for calls, errors in valid)


def test_auto_choice_and_forced_tool(setup):
    tok, _, compiler, _ = setup
    for c in _outputs(setup, compiler.tool_calls(TOOLS, tool_choice="auto", max_calls=1), max_tokens=120):
        text = tok.decode(c.token_ids)
        calls, errors = parse_tool_calls(text, TOOLS)
        assert errors == [] and len(calls) <= 1, text
        assert c.finish_reason == "stop" or SECTION_BEGIN not in text  # a started section is always closed
    for c in _outputs(setup, compiler.tool_calls(TOOLS, tool_choice="finish", parallel_tool_calls=False)):
        calls, errors = parse_tool_calls(tok.decode(c.token_ids), TOOLS)
        assert errors == [] and [x.name for x in calls] == ["finish"]


def test_matcher_rejects_invalid_json_and_resumes(setup):
    tok, engine, compiler, prompt = setup
    grammar = compiler.tool_calls(TOOLS)  # free counters, any number of calls
    prefix = SECTION_BEGIN + CALL_BEGIN + "functions.read_file:17" + ARGUMENTS_BEGIN + '{"path": "a'
    m = grammar.matcher()
    assert m.accept_text(prefix)
    assert not grammar.matcher().accept_text(SECTION_BEGIN + CALL_BEGIN + "functions.delete:0")
    assert not m.accept_text("\t")  # raw control characters are not JSON (xgrammar 0.2.8 allowed them)
    assert not m.accept_text('bcdefgh"')  # maxLength 6
    # a paused request resumes with its grammar state rebuilt from the tokens it already has
    ids = tok.encode(prefix)
    engine.add_request(prompt, SamplingParams(max_tokens=300, grammar=grammar, seed=3), prior=ids,
                       prior_logprobs=[0.0] * len(ids))
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    (done,) = finished
    calls, errors = parse_tool_calls(tok.decode(done.token_ids), TOOLS)
    assert errors == [] and calls[0].id == "functions.read_file:17" and calls[0].arguments["path"].startswith("a")
    with pytest.raises(ValueError, match="violates its grammar"):
        bad = tok.encode("hello")
        engine.add_request(prompt, SamplingParams(grammar=grammar), prior=bad, prior_logprobs=[0.0] * len(bad))
    # auto: free text, then one section; markers outside a section are refused
    auto = compiler.tool_calls(TOOLS, tool_choice="auto")
    m = auto.matcher()
    call = ToolCall("functions.finish:0", "finish", {"ok": True})
    assert m.accept_text("I will finish now. ") and m.accept_text(render_tool_calls([call]))
    assert m.accept(tok.eos_id) and m.is_terminated()
    assert not auto.matcher().accept_text("text " + CALL_BEGIN)
    with pytest.raises(ValueError, match="neither"):
        tool_call_format(TOOLS, tool_choice="delete")
