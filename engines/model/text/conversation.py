"""A multi-turn tool-using episode as tokens, rendered by the tokenizer's own chat template.

The model's generated tokens are kept verbatim (they carry its log-probs); each observation is the text the
chat template adds after them: the delta between ``apply_chat_template(messages + [the model's turn] +
observation messages, add_generation_prompt=True)`` and the text the model has seen so far. The model's
turn is recorded as the OpenAI message that re-renders to its own bytes: ``content`` plus ``tool_calls``
parsed by the family's format (``engines.model.text.chat_format``) where the template renders those exactly as
the model wrote them, else the text as ``content``. So what the model sees in training is byte for byte
``apply_chat_template`` of ``messages``.

When no message re-renders the model's bytes, the observation is the text the template puts after a placeholder
turn (``<placeholder turn> + observation + generation prompt``): the model still sees its own tokens and the
template's text for everything else. Two cases are counted apart: the template renders the model's turn
differently (``inexact_turns``: e.g. Llama 3's template trims whitespace the model wrote), or it rewrites earlier
turns (``rewritten_turns``: e.g. Qwen3's template drops the reasoning of every assistant turn before the latest
user query, so a user message after tool turns changes the history). Either way the token stream stays
append-only, as in the peers' token-in/token-out multi-turn rollouts: what the model generated stays what it sees
next and what it is trained on, and only each observation's delta comes from the template. A template that cannot
render the conversation at all, or drops the model's turn, raises ``ChatFormatError`` naming the template and
turn; the rollout ends that episode there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.model.text.chat_format import ChatFormatError, ToolCall, ToolFormat

_PLACEHOLDER = "\u2063assistant-turn\u2063"


class Conversation:
    """The token stream of one episode: ``prompt_ids`` at the start, then ``add_turn`` per model turn."""

    def __init__(self, tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                 tool_format: ToolFormat | None = None) -> None:
        self.tok, self.tools, self.tool_format = tokenizer, list(tools or []) or None, tool_format
        self.messages: list[dict] = [dict(m) for m in messages]
        self.turns = 0
        self.inexact_turns = 0  # turns whose bytes the template renders differently (see the module doc)
        self.rewritten_turns = 0  # turns after which the template rewrote earlier turns (see the module doc)
        self.rendered = self._render(self.messages)  # the template's text of ``messages`` + generation prompt
        self.text = self.rendered  # what the model has seen: its own bytes in place of its turns
        self.prompt_ids: list[int] = self.tok.encode(self.text)

    @property
    def source(self) -> str:
        return str(getattr(self.tok, "source", "tokenizer"))

    def _render(self, messages: list[dict], generation_prompt: bool = True) -> str:
        return self.tok.hf.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                               add_generation_prompt=generation_prompt)

    def _candidates(self, text: str, calls: list[ToolCall]) -> list[dict]:
        """Assistant messages that may re-render to ``text``: structured (content + tool_calls) first."""
        out = []
        if calls and self.tool_format is not None:
            content = self.tool_format.content_of(text)
            for c in dict.fromkeys([content.rstrip("\n"), content, content.strip()]):
                out.append({"role": "assistant", "content": c, "tool_calls": [call.to_openai() for call in calls]})
        out.append({"role": "assistant", "content": text})
        return out

    def add_turn(self, response_ids: Sequence[int], observation: Sequence[dict],
                 calls: list[ToolCall] | None = None) -> list[int]:
        """Record the model's turn (its tokens, ``calls`` parsed from them) and the observation messages;
        return the observation's token ids (all the template adds up to the next generation prompt)."""
        self.turns += 1
        response_ids = list(response_ids)
        text, seen, calls = self._turn(response_ids, calls)
        observation = [dict(m) for m in observation]
        errors, rendered = [], []
        for msg in self._candidates(text, calls or []):
            try:
                new = self._render([*self.messages, msg, *observation])
            except Exception as e:  # templates raise on conversations they do not support
                errors.append(f"{type(e).__name__}: {e}")
                continue
            if new.startswith(seen):
                return self._advance(msg, observation, new, new[len(seen):], seen)
            rendered.append((msg, new))
        if not rendered:
            raise ChatFormatError(f"the chat template of {self.source} cannot render turn {self.turns} of the "
                                  f"conversation: {'; '.join(errors) or 'no candidate message'}")
        return self._delta_after_placeholder(response_ids, observation, rendered, seen)

    def _turn(self, response_ids: list[int], calls: list[ToolCall] | None) -> tuple[str, str, list[ToolCall] | None]:
        """The turn's message text (without EOS), what the model has seen through it, and its calls (parsed in
        the family's format when not given)."""
        text = self.tok.decode(response_ids)
        seen = self.text + self.tok.hf.decode(response_ids, skip_special_tokens=False)
        if calls is None and self.tool_format is not None:
            calls, _ = self.tool_format.parse(text)
        return text, seen, calls

    def _delta_after_placeholder(self, response_ids: list[int], observation: list[dict],
                                 rendered: list[tuple[dict, str]], seen: str) -> list[int]:
        """The observation as the template renders it after a placeholder turn, for a turn the template does not
        re-render byte for byte (``rendered``: each candidate message and its rendering, structured first)."""
        base = self._render(self.messages, generation_prompt=False)
        marked = self._render([*self.messages, {"role": "assistant", "content": _PLACEHOLDER}, *observation])
        at = marked.find(_PLACEHOLDER)
        if at < 0:
            raise ChatFormatError(f"the chat template of {self.source} drops the model's turn {self.turns}: no "
                                  "observation can be placed after it")
        if marked.startswith(base) and all(new.startswith(base) for _, new in rendered):
            self.inexact_turns += 1  # only the model's own turn renders otherwise: keep it as plain text
            msg, new = next(((m, n) for m, n in rendered if "tool_calls" not in m), rendered[0])
        else:
            self.rewritten_turns += 1  # earlier turns changed: keep the structured turn for later renderings
            msg, new = rendered[0]
        delta = marked[at + len(_PLACEHOLDER):]
        if response_ids and response_ids[-1] in self.tok.eos_ids:
            eos = self.tok.hf.decode(response_ids[-1:], skip_special_tokens=False)
            delta = delta.removeprefix(eos)  # the model already ended its turn with it
        return self._advance(msg, observation, new, delta, seen)

    def _advance(self, msg: dict, observation: list[dict], rendered: str, delta: str, seen: str) -> list[int]:
        self.messages += [msg, *observation]
        self.rendered, self.text = rendered, seen + delta
        return self.tok.encode(delta)

    def finish(self, response_ids: Sequence[int], calls: list[ToolCall] | None = None) -> None:
        """Record the last turn (no observation follows), for logs and ``messages``."""
        text, seen, calls = self._turn(list(response_ids), calls)
        for msg in self._candidates(text, calls or []):
            try:
                if self._render([*self.messages, msg], generation_prompt=False).startswith(seen):
                    break
            except Exception:  # an unrenderable candidate is simply not the one
                continue
        self.messages.append(msg)
        self.text = seen
