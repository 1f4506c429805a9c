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
plain strings. They, the ``Tool``/``ToolCall`` types and the K2 parser live in ``engines.model.text.chat_format``
(the registry of every family's tool-call format, shared with ``engines.inference.constrained``) and are
re-exported here. What stays here is the K2 text for tokenizers without a chat template: the TypeScript
declaration message and the tool result messages. With a chat template, conversations are rendered by it
(``engines.model.text.conversation``) and the model's family format (``detect_format``) is used instead.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engines.model.text.chat_format import (
    ARGUMENTS_BEGIN,
    CALL_BEGIN,
    CALL_END,
    ID_PREFIX,
    IM_BEGIN,
    IM_END,
    IM_MIDDLE,
    JSON_SEPARATORS,
    NAME_PATTERN,
    SECTION_BEGIN,
    SECTION_END,
    K2Format,
    Tool,
    ToolCall,
    call_id,
    render_arguments,
    validate_arguments,
)

__all__ = ["ARGUMENTS_BEGIN", "CALL_BEGIN", "CALL_END", "ID_PREFIX", "IM_BEGIN", "IM_END", "IM_MIDDLE",
           "JSON_SEPARATORS", "NAME_PATTERN", "SECTION_BEGIN", "SECTION_END", "Tool", "ToolCall", "call_id",
           "parse_tool_calls", "render_arguments", "render_tool_calls", "render_tool_declarations",
           "render_tool_result", "render_tool_results", "render_typescript", "validate_arguments"]

_K2 = K2Format()


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
# Calls (K2)


def render_tool_calls(calls: list[ToolCall]) -> str:
    """The K2 tool-call section the model should emit for ``calls``."""
    return _K2.render_calls(calls)


def parse_tool_calls(text: str, tools: list[Tool] | None = None) -> tuple[list[ToolCall], list[str]]:
    """Parse the K2 tool-call sections of a model response into (valid calls, errors); never raises.

    Text before (and after) a section is ignored; a response without a section has no calls and no
    errors. With ``tools``, calls to undeclared tools and schema violations are errors. A call with
    an error is left out of the calls; the others are kept.
    """
    return _K2.parse(text, tools)


# ---------------------------------------------------------------------------------------------------
# Results


def render_tool_result(call: ToolCall, result: str) -> str:
    """One K2 tool result message for ``call``."""
    return f"{IM_BEGIN}tool{IM_MIDDLE}## Results of {call.id}\n{result}{IM_END}"


def render_tool_results(results: list[tuple[ToolCall, str]]) -> str:
    """The observation fed back to the model: one tool result message per call, in call order."""
    return "".join(render_tool_result(call, result) for call, result in results)
