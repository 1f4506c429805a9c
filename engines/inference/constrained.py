"""Constrained decoding of tool calls with xgrammar: every sampled token keeps the output a prefix of
a valid K2 tool-call section whose arguments satisfy the chosen tool's JSON schema.

The grammar is an xgrammar structural tag: the section/call markers and call ids of
``engines.model.text.chat_format`` as constant strings, and for each tool the EBNF that
``xgrammar.Grammar.from_json_schema`` makes of its parameters (the JSON separators of
``chat_format.render_arguments``, so that a constrained call re-renders to the very same text).
Constrained calls are available for the ``k2`` and ``hermes`` (Qwen) formats (``tool_format``).
The engine uses it through two small objects:

- a constraint (``GrammarConstraint``), set as ``SamplingParams.grammar``; its ``matcher()`` makes
- a per-sequence matcher (``GrammarMatcher``): ``allowed_mask()`` for the next token,
  ``accept(token)`` and ``is_terminated()``.

The grammar ends with the tokenizer's EOS (a stop token), so a constrained response ends where the
section ends, with EOS, and the engine reports it as an ordinary stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch
import xgrammar as xgr
from tokenizers import Tokenizer
from xgrammar.structural_tag import (
    ConstStringFormat,
    GrammarFormat,
    OptionalFormat,
    OrFormat,
    RegexFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

from engines.model.text.chat_format import (
    ARGUMENTS_BEGIN,
    CALL_BEGIN,
    CALL_END,
    ID_PREFIX,
    JSON_SEPARATORS,
    SECTION_BEGIN,
    SECTION_END,
    HermesFormat,
    Tool,
)
from engines.model.text.tokenizer import TextTokenizer

ToolChoice = Literal["auto", "required"] | str
#: The tool-call formats (``engines.model.text.chat_format``) constrained decoding has a grammar for.
CONSTRAINED_FORMATS = ("k2", "hermes")
#: Unrolled depth of the exact-counter grammar when ``max_calls`` is not given.
DEFAULT_MAX_CALLS = 16
# Free counters: no leading zeros and at most 6 digits, so that a weak model cannot loop on digits.
_COUNTER_REGEX = r"(0|[1-9][0-9]{0,5})"
_SHIFTS = torch.arange(32, dtype=torch.int32)
# xgrammar 0.2.8 writes the characters of a length-bounded string (minLength/maxLength) as
# [^"\\\r\n], which admits raw control characters (a tab, \x01...) that JSON forbids and
# json.loads rejects; its unbounded strings exclude them. Narrow the class the same way.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


class Matcher(Protocol):
    """What the engine needs of a per-sequence matcher."""

    def allowed_mask(self) -> torch.Tensor: ...
    def accept(self, token: int) -> bool: ...
    def is_terminated(self) -> bool: ...


class Constraint(Protocol):
    """What ``SamplingParams.grammar`` must be: a factory of fresh per-sequence matchers."""

    def matcher(self) -> Matcher: ...


class GrammarMatcher:
    """The xgrammar matcher of one sequence: allowed next tokens, accepted tokens, termination."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def allowed_mask(self) -> torch.Tensor:
        """Bool tensor [vocab_size] of the tokens the grammar allows next (only stop tokens once complete)."""
        self._m.fill_next_token_bitmask(self._bitmask)
        bits = (self._bitmask[0, :, None] >> _SHIFTS) & 1  # bit j of word i is token 32 * i + j
        return bits.bool().flatten()[: self.vocab_size]

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False (state unchanged) if the grammar does not allow it."""
        return bool(self._m.accept_token(int(token)))

    def accept_text(self, text: str) -> bool:
        """Advance past ``text`` (tests, or a prompt-side prefill of the section)."""
        return bool(self._m.accept_string(text))

    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return bool(self._m.is_terminated())


class GrammarConstraint:
    """A compiled grammar to set as ``SamplingParams.grammar``; ``matcher()`` starts one sequence."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, description: str = "grammar",
                 source: tuple[str, str] | None = None) -> None:
        """``source``: what it was compiled from, as vLLM's structured outputs take it (``("structural_tag",
        json)`` or ``("grammar", ebnf)``), so that another engine compiles the very same constraint."""
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.description = description
        self.source = source

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""
        return GrammarMatcher(self.compiled, self.vocab_size)

    def __repr__(self) -> str:
        return f"GrammarConstraint({self.description})"


def _backend(tokenizer: TextTokenizer | Tokenizer) -> Tokenizer:
    if isinstance(tokenizer, TextTokenizer):
        return tokenizer.tok
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers' PreTrainedTokenizerFast
    if isinstance(backend, Tokenizer):
        return backend
    raise TypeError(f"unsupported tokenizer {type(tokenizer).__name__}")


def tokenizer_info(tokenizer: TextTokenizer | Tokenizer, vocab_size: int | None = None,
                   stop_token_ids: Sequence[int] | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of our tokenizer; ``vocab_size`` is the model's (logits width), which may differ."""
    from transformers import PreTrainedTokenizerFast

    tok = _backend(tokenizer)
    if stop_token_ids is None:
        if not isinstance(tokenizer, TextTokenizer):
            raise ValueError("stop_token_ids are needed for a tokenizer without an EOS id")
        stop_token_ids = [tokenizer.eos_id]
    # xgrammar detects the vocabulary type (byte-level, byte-fallback, raw) from the HF wrapper ...
    detected = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok),
                                                  stop_token_ids=list(stop_token_ids))
    # ... but treats added tokens it does not know as special (e.g. our <|pad|>) as text, so a JSON
    # string could contain a pad token that decode() drops. An empty string marks a token special.
    encoded = [""] * tok.get_vocab_size(with_added_tokens=True)
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        encoded[i] = text
    for i, added in tok.get_added_tokens_decoder().items():
        if added.special:
            encoded[i] = ""
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size or len(encoded),
                             stop_token_ids=list(stop_token_ids), add_prefix_space=detected.add_prefix_space)


def _arguments_grammar(tool: Tool) -> str:
    """EBNF of the tool's arguments: compact JSON valid for its schema (xgrammar's converter)."""
    try:
        grammar = xgr.Grammar.from_json_schema(tool.parameters, any_whitespace=False, separators=JSON_SEPARATORS)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses on unsupported schemas
        raise ValueError(f"cannot build a grammar for the schema of tool {tool.name!r}: {exc}") from exc
    return str(grammar).replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def tool_call_format(tools: Sequence[Tool], *, tool_choice: ToolChoice = "required", parallel_tool_calls: bool = True,
                     first_counter: int | None = None, max_calls: int | None = None,
                     tool_format: str = "k2") -> StructuralTag:
    """The structural tag of tool calls to ``tools`` in ``tool_format`` (``CONSTRAINED_FORMATS``).

    ``tool_choice``: "required" (the response is one tool-call section), "auto" (free text, then
    at most one section, K2's enforcer behaviour) or a tool name (one section calling that tool).
    ``first_counter`` pins the call ids to ``functions.NAME:first_counter``, ``:first_counter+1``...
    (the dialog's running counter); otherwise any counter is allowed. ``max_calls`` bounds the calls
    of the section (1 if not ``parallel_tool_calls``). In ``hermes`` (Qwen) format the calls are
    ``<tool_call>`` blocks (no ids); "auto" there allows free text, then the calls.
    """
    if tool_format not in CONSTRAINED_FORMATS:
        raise ValueError(f"constrained tool calls are available for the formats {', '.join(CONSTRAINED_FORMATS)}, "
                         f"not {tool_format!r}")
    if not tools:
        raise ValueError("constrained tool calling needs at least one tool")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tool names in {names}")
    if tool_choice not in ("auto", "required"):
        tools = [t for t in tools if t.name == tool_choice]
        if not tools:
            raise ValueError(f"tool_choice {tool_choice!r} is neither 'auto', 'required' nor a declared tool")
    if not parallel_tool_calls:
        max_calls = 1
    if max_calls is not None and max_calls < 1:
        raise ValueError(f"max_calls must be >= 1, got {max_calls}")
    arguments = {t.name: GrammarFormat(grammar=_arguments_grammar(t)) for t in tools}
    if tool_format == "hermes":
        return _hermes_format(tools, arguments, tool_choice, max_calls)

    def call(tool: Tool, counter: int | None) -> TagFormat:
        if counter is None:  # free counter: a regex between the fixed id prefix and the arguments marker
            return TagFormat(begin=f"{CALL_BEGIN}{ID_PREFIX}{tool.name}:", end=CALL_END, content=SequenceFormat(
                elements=[RegexFormat(pattern=_COUNTER_REGEX), ConstStringFormat(value=ARGUMENTS_BEGIN),
                          arguments[tool.name]]))
        return TagFormat(begin=f"{CALL_BEGIN}{ID_PREFIX}{tool.name}:{counter}{ARGUMENTS_BEGIN}",
                         content=arguments[tool.name], end=CALL_END)

    if first_counter is None and max_calls is None:
        calls = TagsWithSeparatorFormat(tags=[call(t, None) for t in tools], separator="", at_least_one=True)
    else:
        # Unrolled: call 1, then optionally call 2, ... so that each position can carry its own counter.
        depth = max_calls or DEFAULT_MAX_CALLS
        calls = None
        for i in reversed(range(depth)):
            counter = None if first_counter is None else first_counter + i
            one = OrFormat(elements=[call(t, counter) for t in tools])
            calls = one if calls is None else SequenceFormat(elements=[one, OptionalFormat(content=calls)])
    if tool_choice == "auto":
        section = TagFormat(begin=SECTION_BEGIN, content=calls, end=SECTION_END)
        # Free text may not contain the other markers: a call outside a section would be lost.
        fmt = TriggeredTagsFormat(triggers=[SECTION_BEGIN], tags=[section], stop_after_first=True,
                                  excludes=[CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END, SECTION_END])
    else:
        fmt = SequenceFormat(elements=[ConstStringFormat(value=SECTION_BEGIN), calls,
                                       ConstStringFormat(value=SECTION_END)])
    return StructuralTag(format=fmt)


def _hermes_format(tools: Sequence[Tool], arguments: dict[str, GrammarFormat], tool_choice: ToolChoice,
                   max_calls: int | None) -> StructuralTag:
    """Qwen/Hermes calls, exactly as ``chat_format.HermesFormat.render_calls`` writes them."""
    begin, end = HermesFormat.BEGIN, HermesFormat.END
    tags = [TagFormat(begin=f'{begin}\n{{"name": "{t.name}", "arguments": ', content=arguments[t.name],
                      end=f"}}\n{end}") for t in tools]
    if tool_choice == "auto":
        return StructuralTag(format=TriggeredTagsFormat(triggers=[begin], tags=tags, stop_after_first=max_calls == 1,
                                                        excludes=[end]))
    if max_calls == 1:
        return StructuralTag(format=OrFormat(elements=tags))
    return StructuralTag(format=TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True))


class ConstraintCompiler:
    """Compiles constraints for one tokenizer and model vocabulary (reuse it: setting up is the slow part)."""

    def __init__(self, tokenizer: TextTokenizer | Tokenizer, vocab_size: int | None = None,
                 stop_token_ids: Sequence[int] | None = None) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = self.info.vocab_size
        self._compiler = xgr.GrammarCompiler(self.info)

    def tool_calls(self, tools: Sequence[Tool], *, tool_choice: ToolChoice = "required",
                   parallel_tool_calls: bool = True, first_counter: int | None = None,
                   max_calls: int | None = None, tool_format: str = "k2") -> GrammarConstraint:
        """A constraint for tool calls to ``tools`` (see ``tool_call_format`` for the options)."""
        tag = tool_call_format(tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                               first_counter=first_counter, max_calls=max_calls, tool_format=tool_format)
        compiled = self._compiler.compile_structural_tag(tag)
        names = ", ".join(t.name for t in tools)
        return GrammarConstraint(compiled, self.vocab_size, f"tool calls to {names} ({tool_choice})",
                                 ("structural_tag", tag.model_dump_json()))
