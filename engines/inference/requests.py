"""What the inference engine knows of one request, and what it hands back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.inference.blocks import SeqBlocks
from engines.inference.sampling import InvalidRequestError, SamplingParams

#: The most likely tokens at one position as (id, log-prob), best first.
TopLogprobs = list[tuple[int, float]]


@dataclass
class Completion:
    """One response. ``finish_reason``: "stop" (EOS, stop token or stop string, named in
    ``stop_reason``), "length" (token budget), "error" (``error`` says why) or None (paused).
    ``top_logprobs``: with ``params.top_logprobs`` > 0, each token's position's most likely tokens (None for the
    tokens of a resumed request's earlier part); None otherwise."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    prompt_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    error: str | None = None
    request_id: int = -1
    params: SamplingParams | None = None
    top_logprobs: list[TopLogprobs | None] | None = None
    #: with routes recorded (an MoE model's engine asked for them), the experts each fed token took: an int
    #: [tokens, MoE layers, k] array over the prompt and the generated tokens the model read (all but the last)
    routed_experts: Any = None
    #: the images the request's prompt carried (a paused request resumes with them)
    images: Sequence[Any] = ()


@dataclass(frozen=True)
class Progress:
    """What an unfinished request generated from its token ``start`` on (what a server streams): the tokens, their
    log-probs and, as in ``Completion``, their positions' most likely tokens when the request asks for them."""

    start: int
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs | None] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (temperature 1, no filters) given the tokens before it, and the
    ``top`` most likely tokens at its position as (id, log-prob), best first."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(eq=False, kw_only=True)
class Request:
    """A request inside the engine. ``tokens``/``logprobs`` are everything generated so far (a resumed
    request's earlier tokens first); ``seq`` its KV blocks while it holds some."""

    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    matcher: Any = None  # per-sequence grammar state when params.grammar is set (engines.inference.constrained)
    seq: SeqBlocks | None = None
    #: requests with the very same tokens that take this one's prefill (the K samples of a prompt)
    followers: list[Request] = field(default_factory=list)
    order: int = 0  # admission order: the newest is preempted first

    @property
    def context(self) -> list[int]:
        """Every token of the sequence so far (prompt, then generated)."""
        return self.prompt + self.tokens

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.tokens)

    filter_kind: int = 0  # how its tokens are drawn (``engines.inference.sampling.filter_kind``)
    #: with ``params.top_logprobs`` > 0, the most likely tokens at each generated position (None: a prior token)
    top_logprobs: list[TopLogprobs | None] | None = None

    def completion(self, reason: str | None, stop_reason: int | str | None = None) -> Completion:
        tops = None if self.top_logprobs is None else list(self.top_logprobs)
        return Completion(list(self.tokens), list(self.logprobs), reason, self.prompt, stop_reason=stop_reason,
                          request_id=self.id, params=self.params, top_logprobs=tops)

    def progress(self, start: int) -> Progress:
        """What it generated from token ``start`` on."""
        tops = None if self.top_logprobs is None else self.top_logprobs[start:]
        return Progress(start, self.tokens[start:], self.logprobs[start:], tops)


#: Most stop token ids one request may name (besides EOS).
MAX_STOP_IDS = 16


def check_prompt(prompt_ids: Sequence[int], *, vocab: int, context: int) -> list[int]:
    """The prompt as ints, or InvalidRequestError naming why it cannot be read (empty, ids outside the
    vocabulary, longer than the context)."""
    prompt = _token_ids(prompt_ids, vocab)
    if len(prompt) > context:
        raise InvalidRequestError(f"prompt has {len(prompt)} tokens; it exceeds the model's context of {context} "
                                  "tokens")
    return prompt


def check_request(prompt_ids: Sequence[int], params: SamplingParams, prior: Sequence[int],
                  prior_logprobs: Sequence[float], *, vocab: int, context: int, max_seq_len: int,
                  detokenizes: bool, step_top_logprobs: bool = False) -> list[int]:
    """The prompt as ints, or InvalidRequestError naming why an engine cannot serve the request (the same
    rules for every engine, so a request refused by one is refused by the other; ``step_top_logprobs``: whether
    the engine reports the alternatives ``params.top_logprobs`` asks for)."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
    prompt = _token_ids(prompt_ids, vocab)
    if len(prompt) + params.max_tokens > context:
        raise InvalidRequestError(f"prompt has {len(prompt)} tokens; with max_tokens={params.max_tokens} it "
                                  f"exceeds the model's context of {context} tokens")
    if len(prompt) + params.max_tokens > max_seq_len:
        raise InvalidRequestError(
            f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} does not fit the KV cache, "
            f"which holds {max_seq_len} tokens per sequence (max_seq_len)")
    if len(prior) != len(prior_logprobs) or len(prior) >= params.max_tokens:
        raise InvalidRequestError(f"resumed request has {len(prior)} tokens and {len(prior_logprobs)} logprobs "
                                  f"for max_tokens={params.max_tokens}")
    if params.top_logprobs and not step_top_logprobs:  # the engine's capabilities say why (step_top_logprobs)
        raise InvalidRequestError("top_logprobs: this engine reports no alternatives from its steps; score the "
                                  "tokens with prompt_logprobs")
    if params.stop and not detokenizes:
        raise InvalidRequestError("stop strings need an engine built with a detokenize function")
    if len(params.stop_token_ids) > MAX_STOP_IDS:
        raise InvalidRequestError(f"at most {MAX_STOP_IDS} stop_token_ids, got {len(params.stop_token_ids)}")
    return prompt


def _token_ids(prompt_ids: Sequence[int], vocab: int) -> list[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise InvalidRequestError("prompt is empty")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return prompt
