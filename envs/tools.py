"""Tool calling in the Kimi K2 token format (K2 technical report, appendix B).

Three pieces of text make up a tool-using dialog:

- the tool declaration message, put in the prompt::

      <|im_begin|>tool_declare<|im_middle|># Tools
      namespace functions { ... TypeScript declarations ... }<|im_end|>

- the tool-call section the model emits::

      <|tool_call_section_begin|><|tool_call_begin|>functions.NAME:COUNTER<|tool_arguments_begin|>{JSON}
      <|tool_call_end|>...more calls...<|tool_call_section_end|>

  (without the line break), where COUNTER counts all tool calls of the dialog from 0;

- one tool result message per call::

      <|im_begin|>tool<|im_middle|>## Results of functions.NAME:COUNTER
      RESULT<|im_end|>

The markers are special tokens in K2; our tokenizers have no special tokens for them, so they are
plain strings here (module constants, so that the grammar in ``engines.inference.constrained`` uses the same).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

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
# K2 serialises arguments with ``json.dumps`` defaults (", " / ": "), non-ASCII kept as is; the
# constrained decoder uses the same separators so that constrained output renders identically.
JSON_SEPARATORS = (", ", ": ")

_ID_RE = re.compile(rf"{re.escape(ID_PREFIX)}({NAME_PATTERN}):(\d+)")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


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
        return cls(
            name=fn["name"],
            description=fn.get("description", ""),
            parameters=dict(fn.get("parameters") or _EMPTY_PARAMETERS),
        )

    def to_openai(self) -> dict:
        """The OpenAI chat-completions form of this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    """One call the model requested: id ``functions.{name}:{counter}``, tool name, parsed arguments."""

    id: str
    name: str
    arguments: dict = field(hash=False)


def call_id(name: str, counter: int) -> str:
    """K2's call id: ``functions.{name}:{counter}``, the counter running over the whole dialog from 0."""
    return f"{ID_PREFIX}{name}:{counter}"


# ---------------------------------------------------------------------------------------------------
# Declarations


def _ts_literal(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _ts_type(schema: Any, indent: str) -> str:
    """A TypeScript type for a JSON Schema; constructs TypeScript cannot say become ``any``."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(_ts_literal(v) for v in schema["enum"]) or "never"
    if "const" in schema:
        return _ts_literal(schema["const"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_ts_type(s, indent) for s in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_ts_type({**schema, "type": k}, indent) for k in kind)
    if kind in ("integer", "number"):
        return "number"
    if kind in ("string", "boolean", "null"):
        return kind
    if kind == "array":
        item = _ts_type(schema.get("items", {}), indent)
        return f"({item})[]" if " | " in item else f"{item}[]"
    if kind == "object" or "properties" in schema:
        return _ts_object(schema, indent)
    return "any"


def _ts_object(schema: dict, indent: str) -> str:
    props = schema.get("properties") or {}
    if not props:
        return "object"
    required = set(schema.get("required", []))
    inner = indent + "  "
    lines = []
    for i, (name, sub) in enumerate(props.items()):
        desc = sub.get("description") if isinstance(sub, dict) else None
        if desc:
            lines.extend(f"{inner}// {line}" for line in str(desc).splitlines())
        if isinstance(sub, dict) and "default" in sub:
            lines.append(f"{inner}// Default: {_ts_literal(sub['default'])}")
        optional = "" if name in required else "?"
        key = name if re.fullmatch(r"[A-Za-z_$][A-Za-z0-9_$]*", name) else _ts_literal(name)
        comma = "," if i < len(props) - 1 else ""
        lines.append(f"{inner}{key}{optional}: {_ts_type(sub, inner)}{comma}")
    return "{\n" + "\n".join(lines) + f"\n{indent}}}"


def render_typescript(tools: list[Tool]) -> str:
    """The tool declaration content in TypeScript, as in the report's listing 2."""
    lines = ["namespace functions {"]
    for tool in tools:
        lines.extend(f"// {line}" for line in tool.description.splitlines())
        lines.append(f"type {tool.name} = (_: {_ts_object(tool.parameters, '')}) => any;")
    lines.append("}")
    return "\n".join(lines)


def render_tool_declarations(tools: list[Tool], language: str = "typescript") -> str:
    """The K2 tool declaration message; ``language="json"`` declares the tools in OpenAI JSON instead."""
    if language == "typescript":
        content = render_typescript(tools)
    elif language == "json":
        content = json.dumps([t.to_openai() for t in tools], ensure_ascii=False, indent=2)
    else:
        raise ValueError(f"unknown declaration language {language!r}")
    return f"{IM_BEGIN}tool_declare{IM_MIDDLE}# Tools\n{content}{IM_END}"


# ---------------------------------------------------------------------------------------------------
# Calls


def render_arguments(arguments: dict) -> str:
    """The JSON text of a call's arguments, exactly as the model should emit it."""
    return json.dumps(arguments, ensure_ascii=False, separators=JSON_SEPARATORS)


def render_tool_calls(calls: list[ToolCall]) -> str:
    """The tool-call section the model should emit for ``calls``."""
    body = "".join(f"{CALL_BEGIN}{c.id}{ARGUMENTS_BEGIN}{render_arguments(c.arguments)}{CALL_END}" for c in calls)
    return f"{SECTION_BEGIN}{body}{SECTION_END}"


def validate_arguments(tool: Tool, arguments: dict) -> list[str]:
    """JSON-schema errors of ``arguments`` against ``tool.parameters`` (empty when valid)."""
    try:
        cls = jsonschema.validators.validator_for(tool.parameters)
        cls.check_schema(tool.parameters)
        validator = cls(tool.parameters)
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
    except jsonschema.SchemaError as exc:
        return [f"invalid schema for tool {tool.name}: {exc.message}"]
    out = []
    for err in errors:
        where = "/".join(str(p) for p in err.absolute_path)
        out.append(f"{where or '<root>'}: {err.message}")
    return out


def _parse_call(raw: str, tools_by_name: dict[str, Tool] | None) -> tuple[ToolCall | None, list[str]]:
    """One ``ID<|tool_arguments_begin|>JSON`` (markers around it already stripped)."""
    if ARGUMENTS_BEGIN not in raw:
        return None, [f"tool call {raw[:80]!r} has no {ARGUMENTS_BEGIN}"]
    raw_id, raw_args = raw.split(ARGUMENTS_BEGIN, 1)
    raw_id = raw_id.strip()
    match = _ID_RE.fullmatch(raw_id)
    if match is None:
        return None, [f"malformed call id {raw_id[:80]!r} (expected {ID_PREFIX}NAME:COUNTER)"]
    name = match.group(1)
    try:
        arguments = json.loads(raw_args)
    except json.JSONDecodeError as exc:
        return None, [f"{raw_id}: arguments are not valid JSON ({exc})"]
    if not isinstance(arguments, dict):
        return None, [f"{raw_id}: arguments must be a JSON object, got {type(arguments).__name__}"]
    if tools_by_name is not None:
        tool = tools_by_name.get(name)
        if tool is None:
            return None, [f"{raw_id}: unknown tool {name!r}"]
        errors = validate_arguments(tool, arguments)
        if errors:
            return None, [f"{raw_id}: {e}" for e in errors]
    return ToolCall(id=raw_id, name=name, arguments=arguments), []


def parse_tool_calls(text: str, tools: list[Tool] | None = None) -> tuple[list[ToolCall], list[str]]:
    """Parse the tool-call sections of a model response into (valid calls, errors); never raises.

    Text before (and after) a section is ignored; a response without a section has no calls and no
    errors. With ``tools``, calls to undeclared tools and schema violations are errors. A call with
    an error is left out of the calls; the others are kept.
    """
    tools_by_name = None if tools is None else {t.name: t for t in tools}
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = text.find(SECTION_BEGIN)
    while pos >= 0:
        start = pos + len(SECTION_BEGIN)
        end = text.find(SECTION_END, start)
        if end < 0:
            errors.append(f"tool-call section not closed by {SECTION_END}")
            body = text[start:]
        else:
            body = text[start:end]
        calls_here, errors_here = _parse_section(body, tools_by_name)
        calls.extend(calls_here)
        errors.extend(errors_here)
        pos = -1 if end < 0 else text.find(SECTION_BEGIN, end + len(SECTION_END))
    seen: set[str] = set()
    for call in calls:
        if call.id in seen:
            errors.append(f"duplicate call id {call.id}")
        seen.add(call.id)
    return calls, errors


def _parse_section(body: str, tools_by_name: dict[str, Tool] | None) -> tuple[list[ToolCall], list[str]]:
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
        call, call_errors = _parse_call(raw, tools_by_name)
        if call is not None:
            calls.append(call)
        errors.extend(call_errors)
        pos = end + len(CALL_END)
    if not calls and not errors:
        errors.append("empty tool-call section")
    return calls, errors


# ---------------------------------------------------------------------------------------------------
# Results


def render_tool_result(call: ToolCall, result: str) -> str:
    """One K2 tool result message for ``call``."""
    return f"{IM_BEGIN}tool{IM_MIDDLE}## Results of {call.id}\n{result}{IM_END}"


def render_tool_results(results: list[tuple[ToolCall, str]]) -> str:
    """The observation fed back to the model: one tool result message per call, in call order."""
    return "".join(render_tool_result(call, result) for call, result in results)
