"""Incremental detokenization: the text of a growing list of tokens at a cost that does not grow with the list.

As vLLM's incremental detokenizer: each new token is decoded in a short window, the tokens read last (whose text
is known, so that a tokenizer that drops a leading space at the start of a text sees the token in context) and the
tokens not read yet; the window's text past the context's is the new text. Text that ends in "\\ufffd" (an
incomplete UTF-8 character: a byte-level token can end in the middle of one) waits for the next token. Tokens
whose text is empty (special tokens a decode skips) are read without becoming the next context, so a run of them
does not widen the window.

The text is read at token boundaries only, and each one is recorded (tokens read, characters of text): what a
server may send as whole tokens, and where a stop string found in the text is cut back to a token boundary.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

#: An incomplete character whose tokens are still unread after this many is taken as invalid bytes (replacement
#: characters for good), so a stream of bytes that never form a character cannot widen the window without end.
MAX_UNREAD = 16


class IncrementalText:
    """The text of the tokens ``extend`` adds, as ``decode`` of them all would give it (for tokenizers whose text
    adds up across character boundaries, as byte-level BPE and SentencePiece do), decoding a few tokens per token."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.read = 0  # tokens whose text is read
        self._pieces: list[str] = []  # the text read at each boundary (appending to one string would copy it all)
        self._context: list[int] = []  # the last tokens read that had text, decoded alone: self._context_text
        self._context_text = ""
        # token boundaries the text was read at: tokens read, characters of text then (both increasing)
        self._tokens: list[int] = [0]
        self._chars: list[int] = [0]

    def extend(self, ids: Iterable[int]) -> None:
        """Add tokens, reading the text of each as far as it is complete."""
        for t in ids:
            self.ids.append(int(t))
            self._advance(final=False)

    @property
    def text(self) -> str:
        """The text read so far (joined on each call: for the end of a stream, not every step)."""
        return "".join(self._pieces)

    @property
    def length(self) -> int:
        """Characters of the text read so far."""
        return self._chars[-1]

    def between(self, start: int, end: int) -> str:
        """The text of tokens ``start:end``, both boundaries the text was read at."""
        return "".join(self._pieces[self._boundary_index(start): self._boundary_index(end)])

    def finish(self) -> None:
        """No more tokens: read what is left, an incomplete character included (as decoding them all would)."""
        if self.read < len(self.ids):
            self._advance(final=True)

    def boundary(self, chars: int) -> int:
        """The most tokens whose text (read at a boundary) is at most ``chars`` characters long (0 if ``chars`` < 0)."""
        i = bisect.bisect_right(self._chars, chars) - 1
        return self._tokens[i] if i >= 0 else 0

    def chars(self, tokens: int) -> int:
        """The length of the text of the first ``tokens`` tokens, a boundary the text was read at."""
        return self._chars[self._boundary_index(tokens)]

    def _boundary_index(self, tokens: int) -> int:
        i = bisect.bisect_left(self._tokens, tokens)
        if i == len(self._tokens) or self._tokens[i] != tokens:
            raise ValueError(f"{tokens} tokens is not a boundary the text was read at")
        return i

    def cut(self, stop: str) -> int | None:
        """How many tokens to keep so that the text ends before the first ``stop`` in it (None: not in it)."""
        end = self.text.find(stop)
        return None if end < 0 else self.boundary(end)

    def _advance(self, final: bool) -> None:
        unread = self.ids[self.read:]
        window = self.decode(self._context + unread)
        if window.endswith("\ufffd") and not final and len(unread) < MAX_UNREAD:
            return  # the last character may still be completed by the next token
        new = window[len(self._context_text):]
        self.read = len(self.ids)
        if new:
            self._context, self._context_text = unread, self.decode(unread)
        self._pieces.append(new)
        self._tokens.append(self.read)
        self._chars.append(self._chars[-1] + len(new))
