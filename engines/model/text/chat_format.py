"""Tool-call formats of model families: the one registry of how a model writes calls and how they are parsed.

A model post-trained for tool use here must call tools the way its own chat template, Hugging Face's
``apply_chat_template(..., tools=...)`` and serving stacks' tool parsers do. So conversations are always
rendered by the tokenizer's chat template (``engines.model.text.conversation``: tools as the template's ``tools``,
results as ``tool`` messages), and the model's calls are parsed by the format of its family:

- ``hermes``: Qwen2.5 / Qwen3 (and Hermes) ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``llama3_json``: Llama 3.x JSON calls ``{"name": ..., "parameters": {...}}`` (an optional ``<|python_tag|>``);
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "9 chars"}]``;
- ``k2``: Kimi K2's markers (technical report, appendix B), for K2-family tokenizers and the embedded default
  tokenizer, whose template is ``K2_CHAT_TEMPLATE``.

``detect_format`` picks a format from the tokenizer's chat template (``model.tool_format`` overrides it).
Adding a family is adding one ``ToolFormat`` subclass and ``register_format`` of an instance. ``render_calls``
writes calls exactly as the family's template renders an assistant message's ``tool_calls``, so a call the
model writes in its format re-renders byte for byte.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

# --- K2 markers (plain strings in our tokenizers; engines.inference.constrained builds its grammar from them)
IM_BEGIN = "<|im_begin|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
SECTION_BEGIN = "<|tool_call_section_begin|>"
SECTION_END = "<|tool_call_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENTS_BEGIN = "<|tool_arguments_begin|>"
CALL_END = "<|tool_call_end|>"
ID_PREFIX = "functions."
#: Tool names usable in a call id ``functions.{name}:{counter}``: no ``:`` and no marker characters.
NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_.\-]*"
# ``json.dumps`` defaults (", " / ": "), non-ASCII kept: what K2 emits and what transformers' ``tojson`` filter
# writes, so calls rendered here equal the templates' renderings of ``tool_calls``.
JSON_SEPARATORS = (", ", ": ")

_ID_RE = re.compile(rf"{re.escape(ID_PREFIX)}({NAME_PATTERN}):(\d+)")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

#: The embedded default tokenizer's chat template: K2's markers, tools declared as OpenAI JSON, an
#: assistant turn ended by the tokenizer's EOS (the token the model stops with).
K2_CHAT_TEMPLATE = (
    "{%- if tools %}" + IM_BEGIN + "tool_declare" + IM_MIDDLE + "# Tools\n{{ tools | tojson(indent=2) }}"
    + IM_END + "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}" + IM_BEGIN + "tool" + IM_MIDDLE + "## Results of {{ m.tool_call_id }}\n"
    "{{ m.content }}" + IM_END +
    "{%- elif m.role == 'assistant' %}" + IM_BEGIN + "assistant" + IM_MIDDLE + "{{ m.content or '' }}"
    "{%- if m.tool_calls %}" + SECTION_BEGIN + "{%- for c in m.tool_calls %}" + CALL_BEGIN + "{{ c.id }}"
    + ARGUMENTS_BEGIN + "{{ c.function.arguments | tojson }}" + CALL_END + "{%- endfor %}" + SECTION_END
    + "{%- endif %}{{ eos_token }}"
    "{%- else %}" + IM_BEGIN + "{{ m.role }}" + IM_MIDDLE + "{{ m.content }}" + IM_END + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}" + IM_BEGIN + "assistant" + IM_MIDDLE + "{%- endif %}"
)


class ChatFormatError(ValueError):
    """A conversation the chat template cannot render consistently, or an unknown tool format."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: name, description and a JSON Schema for its arguments."""

    name: str
    description: str
    # Excluded from the hash so that tools stay hashable (a dict is not); equality still compares it.
    parameters: dict = field(hash=False)

    def __post_init__(self) -> None:
        if not re.fullmatch(NAME_PATTERN, self.name):
            raise ValueError(f"tool name {self.name!r} does not match {NAME_PATTERN}")

    @classmethod
    def from_openai(cls, spec: dict) -> Tool:
        """Build from an OpenAI chat-completions tool ``{"type": "function", "function": {...}}``."""
        fn = spec.get("function", spec) if spec.get("type", "function") == "function" else None
        if fn is None:
            raise ValueError(f"unsupported tool type {spec.get('type')!r}")
        return cls(name=fn["name"], description=fn.get("description", ""),
                   parameters=dict(fn.get("parameters") or _EMPTY_PARAMETERS))

    def to_openai(self) -> dict:
        """The OpenAI chat-completions form of this tool (what chat templates take as ``tools``)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    """One call the model requested: its id, the tool name and the parsed arguments."""

    id: str
    name: str
    arguments: dict = field(hash=False)

    def to_openai(self) -> dict:
        """The call as an OpenAI ``tool_calls`` entry (arguments as an object, as templates expect)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id(name: str, counter: int) -> str:
    """K2's call id: ``functions.{name}:{counter}``, the counter running over the whole dialog from 0."""
    return f"{ID_PREFIX}{name}:{counter}"


def render_arguments(arguments: dict) -> str:
    """The JSON text of a call's arguments, exactly as the model should emit it."""
    return json.dumps(arguments, ensure_ascii=False, separators=JSON_SEPARATORS)


def validate_arguments(tool: Tool, arguments: dict) -> list[str]:
    """JSON-schema errors of ``arguments`` against ``tool.parameters`` (empty when valid)."""
    try:
        cls = jsonschema.validators.validator_for(tool.parameters)
        cls.check_schema(tool.parameters)
        errors = sorted(cls(tool.parameters).iter_errors(arguments), key=lambda e: list(e.absolute_path))
    except jsonschema.SchemaError as exc:
        return [f"invalid schema for tool {tool.name}: {exc.message}"]
    return [f"{'/'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}" for err in errors]


def _checked(cid: str, name: Any, arguments: Any, tools_by_name: dict[str, Tool] | None) -> tuple[ToolCall | None,
                                                                                                   list[str]]:
    """A call from parsed pieces, or the errors that keep it out (bad name, arguments, unknown tool, schema)."""
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        return None, [f"{cid}: malformed tool name {str(name)[:80]!r}"]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return None, [f"{cid}: arguments are not valid JSON ({exc})"]
    if not isinstance(arguments, dict):
        return None, [f"{cid}: arguments must be a JSON object, got {type(arguments).__name__}"]
    if tools_by_name is not None:
        tool = tools_by_name.get(name)
        if tool is None:
            return None, [f"{cid}: unknown tool {name!r}"]
        errors = validate_arguments(tool, arguments)
        if errors:
            return None, [f"{cid}: {e}" for e in errors]
    return ToolCall(id=cid, name=name, arguments=arguments), []


def _by_name(tools: list[Tool] | None) -> dict[str, Tool] | None:
    return None if tools is None else {t.name: t for t in tools}


class ToolFormat:
    """How one model family writes tool calls. Subclasses set ``name`` and ``markers`` (substrings of a chat
    template that identify the family) and implement ``render_calls``, ``parse`` and ``content_of``."""

    name: str = ""
    markers: tuple[str, ...] = ()

    def call_id(self, name: str, counter: int) -> str:
        """The id of the dialog's ``counter``-th call when the model's text carries none."""
        return f"call_{counter}"

    def render_calls(self, calls: list[ToolCall]) -> str:
        """The text the model writes for ``calls`` (as the family's template renders ``tool_calls``)."""
        raise NotImplementedError

    def parse(self, text: str, tools: list[Tool] | None = None, first_counter: int = 0) -> tuple[list[ToolCall],
                                                                                                 list[str]]:
        """(valid calls, errors) of a model response; never raises. Text without calls has neither."""
        raise NotImplementedError

    def content_of(self, text: str) -> str:
        """The response's text before its first call (the assistant message's ``content``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class K2Format(ToolFormat):
    """Kimi K2: ``<|tool_call_section_begin|>`` sections of ``functions.NAME:COUNTER`` calls."""

    name = "k2"
    markers = (SECTION_BEGIN, IM_MIDDLE)

    def call_id(self, name: str, counter: int) -> str:
        return call_id(name, counter)

    def render_calls(self, calls: list[ToolCall]) -> str:
        body = "".join(f"{CALL_BEGIN}{c.id}{ARGUMENTS_BEGIN}{render_arguments(c.arguments)}{CALL_END}" for c in calls)
        return f"{SECTION_BEGIN}{body}{SECTION_END}"

    def content_of(self, text: str) -> str:
        return text.split(SECTION_BEGIN, 1)[0]

    def parse(self, text: str, tools: list[Tool] | None = None, first_counter: int = 0) -> tuple[list[ToolCall],
                                                                                                 list[str]]:
        tools_by_name = _by_name(tools)
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos = text.find(SECTION_BEGIN)
        while pos >= 0:
            start = pos + len(SECTION_BEGIN)
            end = text.find(SECTION_END, start)
            if end < 0:
                errors.append(f"tool-call section not closed by {SECTION_END}")
            here, errs = self._section(text[start:] if end < 0 else text[start:end], tools_by_name)
            calls.extend(here)
            errors.extend(errs)
            pos = -1 if end < 0 else text.find(SECTION_BEGIN, end + len(SECTION_END))
        seen: set[str] = set()
        for call in calls:
            if call.id in seen:
                errors.append(f"duplicate call id {call.id}")
            seen.add(call.id)
        return calls, errors

    def _section(self, body: str, tools_by_name: dict[str, Tool] | None) -> tuple[list[ToolCall], list[str]]:
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos = 0
        while True:
            # Whitespace between calls is tolerated; any other text inside the section is not.
            begin = body.find(CALL_BEGIN, pos)
            gap = body[pos:] if begin < 0 else body[pos:begin]
            if gap.strip():
                errors.append(f"unexpected text in tool-call section: {gap.strip()[:80]!r}")
            if begin < 0:
                break
            start = begin + len(CALL_BEGIN)
            end = body.find(CALL_END, start)
            if end < 0:
                errors.append(f"tool call not closed by {CALL_END}")
                break
            raw = body[start:end]
            if CALL_BEGIN in raw:
                errors.append(f"tool call not closed by {CALL_END} before the next {CALL_BEGIN}")
                pos = start + raw.index(CALL_BEGIN)
                continue
            call, call_errors = self._call(raw, tools_by_name)
            if call is not None:
                calls.append(call)
            errors.extend(call_errors)
            pos = end + len(CALL_END)
        if not calls and not errors:
            errors.append("empty tool-call section")
        return calls, errors

    @staticmethod
    def _call(raw: str, tools_by_name: dict[str, Tool] | None) -> tuple[ToolCall | None, list[str]]:
        if ARGUMENTS_BEGIN not in raw:
            return None, [f"tool call {raw[:80]!r} has no {ARGUMENTS_BEGIN}"]
        raw_id, raw_args = raw.split(ARGUMENTS_BEGIN, 1)
        raw_id = raw_id.strip()
        match = _ID_RE.fullmatch(raw_id)
        if match is None:
            return None, [f"malformed call id {raw_id[:80]!r} (expected {ID_PREFIX}NAME:COUNTER)"]
        try:
            arguments = json.loads(raw_args)
        except json.JSONDecodeError as exc:
            return None, [f"{raw_id}: arguments are not valid JSON ({exc})"]
        return _checked(raw_id, match.group(1), arguments, tools_by_name)


def _json_call(obj: Any, cid: str, args_keys: tuple[str, ...],
               tools_by_name: dict[str, Tool] | None) -> tuple[ToolCall | None, list[str]]:
    """A call from a decoded ``{"name": ..., <one of args_keys>: {...}}`` object."""
    if not isinstance(obj, dict) or "name" not in obj:
        return None, [f"{cid}: a tool call must be a JSON object with a name, got {json.dumps(obj)[:80]}"]
    key = next((k for k in args_keys if k in obj), None)
    return _checked(cid, obj["name"], {} if key is None else obj[key], tools_by_name)


class HermesFormat(ToolFormat):
    """Qwen2.5 / Qwen3 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` per call."""

    name = "hermes"
    markers = ("<tool_call>",)
    BEGIN, END = "<tool_call>", "</tool_call>"

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(f'{self.BEGIN}\n{{"name": "{c.name}", "arguments": {render_arguments(c.arguments)}}}\n'
                         f"{self.END}" for c in calls)

    def content_of(self, text: str) -> str:
        return text.split(self.BEGIN, 1)[0]

    def parse(self, text: str, tools: list[Tool] | None = None, first_counter: int = 0) -> tuple[list[ToolCall],
                                                                                                 list[str]]:
        tools_by_name = _by_name(tools)
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos, n = text.find(self.BEGIN), first_counter
        while pos >= 0:
            start = pos + len(self.BEGIN)
            end = text.find(self.END, start)
            body = text[start:] if end < 0 else text[start:end]
            cid = self.call_id("", n)
            n += 1
            if end < 0:
                errors.append(f"{cid}: tool call not closed by {self.END}")
            try:
                call, errs = _json_call(json.loads(body), cid, ("arguments", "parameters"), tools_by_name)
            except json.JSONDecodeError as exc:
                call, errs = None, [f"{cid}: the tool call is not valid JSON ({exc})"]
            if call is not None:
                calls.append(call)
            errors.extend(errs)
            pos = -1 if end < 0 else text.find(self.BEGIN, end + len(self.END))
        return calls, errors


class Llama3JsonFormat(ToolFormat):
    """Llama 3.x custom tools: the whole response is ``{"name": ..., "parameters": {...}}`` (calls separated by
    ``;``), optionally after ``<|python_tag|>``; a response not starting with ``{`` is plain text."""

    name = "llama3_json"
    markers = ("<|start_header_id|>", "<|python_tag|>")
    PYTHON_TAG = "<|python_tag|>"

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(f'{{"name": "{c.name}", "parameters": {render_arguments(c.arguments)}}}' for c in calls)

    def content_of(self, text: str) -> str:
        body = text.strip().removeprefix(self.PYTHON_TAG).lstrip()
        return "" if body.startswith("{") else text

    def parse(self, text: str, tools: list[Tool] | None = None, first_counter: int = 0) -> tuple[list[ToolCall],
                                                                                                 list[str]]:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return [], []
        tools_by_name = _by_name(tools)
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos, n = 0, first_counter
        while pos < len(body):
            cid = self.call_id("", n)
            n += 1
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                errors.append(f"{cid}: the tool call is not valid JSON ({exc})")
                break
            call, errs = _json_call(obj, cid, ("parameters", "arguments"), tools_by_name)
            if call is not None:
                calls.append(call)
            errors.extend(errs)
            while pos < len(body) and body[pos].isspace():
                pos += 1
            if pos < len(body) and body[pos] != ";":
                errors.append(f"unexpected text after a tool call: {body[pos:pos + 80]!r}")
                break
            pos += 1  # past the ";" between calls
            while pos < len(body) and body[pos].isspace():
                pos += 1
        return calls, errors


class MistralFormat(ToolFormat):
    """Mistral (v0.3 tokenizer): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "abcDEF123"}, ...]``;
    ids are 9 alphanumerics, as Mistral's template requires."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    BEGIN = "[TOOL_CALLS]"
    _ID = re.compile(r"[A-Za-z0-9]{9}")

    def call_id(self, name: str, counter: int) -> str:
        return f"call{counter:05d}"[-9:]

    def render_calls(self, calls: list[ToolCall]) -> str:
        items = [json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)[:-1]
                 + f', "id": "{c.id}"}}' for c in calls]
        return f"{self.BEGIN} [{', '.join(items)}]"

    def content_of(self, text: str) -> str:
        return text.split(self.BEGIN, 1)[0]

    def parse(self, text: str, tools: list[Tool] | None = None, first_counter: int = 0) -> tuple[list[ToolCall],
                                                                                                 list[str]]:
        at = text.find(self.BEGIN)
        if at < 0:
            return [], []
        tools_by_name = _by_name(tools)
        body = text[at + len(self.BEGIN):].lstrip()
        try:
            items, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as exc:
            return [], [f"{self.call_id('', first_counter)}: the tool calls are not a valid JSON list ({exc})"]
        items = items if isinstance(items, list) else [items]
        calls: list[ToolCall] = []
        errors: list[str] = [f"unexpected text after the tool calls: {body[end:].strip()[:80]!r}"] \
            if body[end:].strip() else []
        for i, obj in enumerate(items):
            given = obj.get("id") if isinstance(obj, dict) else None
            cid = given if isinstance(given, str) and self._ID.fullmatch(given) else self.call_id("", first_counter + i)
            call, errs = _json_call(obj, cid, ("arguments", "parameters"), tools_by_name)
            if call is not None:
                calls.append(call)
            errors.extend(errs)
        return calls, errors


FORMATS: dict[str, ToolFormat] = {}


def register_format(fmt: ToolFormat) -> ToolFormat:
    """Add a family's format to the registry (detection tries formats in registration order)."""
    if not fmt.name:
        raise ValueError(f"{fmt!r} has no name")
    FORMATS[fmt.name] = fmt
    return fmt


for _fmt in (MistralFormat(), K2Format(), HermesFormat(), Llama3JsonFormat()):
    register_format(_fmt)
#: The format of tokenizers without a chat template (the embedded default is trained on it).
DEFAULT_FORMAT = "k2"


def get_format(name: str) -> ToolFormat:
    """The registered format called ``name``."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ChatFormatError(f"unknown tool format {name!r}; known: {', '.join(sorted(FORMATS))}") from None


def detect_format(tokenizer: Any, name: str = "auto") -> ToolFormat:
    """The tool format of a tokenizer (a ``TextTokenizer`` or a Hugging Face tokenizer): ``name`` unless it is
    "auto", else the first registered format whose markers occur in its chat template or special tokens."""
    if name != "auto":
        return get_format(name)
    hf = getattr(tokenizer, "hf", tokenizer)
    template = getattr(hf, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates: the default one speaks for the model
        template = template.get("default") or next(iter(template.values()), "")
    if not template:
        return get_format(DEFAULT_FORMAT)
    specials = " ".join(str(t) for t in getattr(hf, "all_special_tokens", []))
    for fmt in FORMATS.values():
        if any(m in template or m in specials for m in fmt.markers):
            return fmt
    raise ChatFormatError(f"the chat template of {getattr(tokenizer, 'source', 'the tokenizer')} matches no tool "
                          f"format ({', '.join(FORMATS)}); set model.tool_format")
