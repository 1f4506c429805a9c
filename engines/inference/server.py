"""An OpenAI-compatible HTTP server over a rollout engine (``rl serve MODEL_DIR [--adapter PEFT_DIR]``).

``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, so a checkpoint can be evaluated with the usual
clients (the ``openai`` package, lm-eval's ``local-completions``...), on the native engine or vLLM. One thread
owns the engine and steps it while requests are pending (``engines.inference.engine_loop``); concurrent HTTP
requests join the same running batch and the ``n`` samples of one request share their prompt's prefill. A request
the engine cannot serve gets a 400 with the reason; the others are not affected.

- ``stream=true`` sends server-sent events as tokens are generated, on both endpoints, and the pieces add up to
  the text (and log-probs) of the same request without streaming: text that could still turn out to be the start
  of a stop string is held back until it cannot. ``stream_options.include_usage`` adds a last chunk with the
  usage.
- ``echo=true`` puts the prompt before the completion's text, and with ``logprobs`` each prompt token's log-prob
  under the model (None for the first, which has nothing before it) before the generated tokens', with
  ``text_offset`` counted in the echoed text. ``max_tokens: 0`` with ``echo`` scores the prompt and generates
  nothing: what lm-eval's loglikelihood requests need.
- ``max_tokens``: None is the room the context leaves after the prompt; 0 only with ``echo``; negative refused.
- ``logprobs`` (completions) / ``top_logprobs`` (chat) above 0: the most likely tokens at each position under the
  model's own distribution (temperature 1), from the engine's own decode steps (``SamplingParams.top_logprobs``) on
  the native engine, from a scoring forward of prompt and tokens on vLLM (whose step alternatives are at the
  request's temperature and filters).

Streaming costs the same per token however long the stream: the text is detokenized incrementally
(``engines.inference.detokenizer``), the engine loop hands over only the new tokens, and the alternatives come with
the tokens (on the native engine; vLLM's are scored per chunk). An echoed prompt is scored once.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from engines.inference.detokenizer import IncrementalText
from engines.inference.engine_loop import EngineLoop, Submitted
from engines.inference.factory import EngineSettings, build_engine, decode_attention
from engines.inference.openai_schema import ChatMessage, ChatRequest, CompletionRequest, SamplingFields, error
from engines.inference.requests import Completion, Progress, TokenLogprob, TopLogprobs
from engines.inference.sampling import InvalidRequestError, SamplingParams
from engines.model.images import ImageError, ImageRef
from engines.model.io.hf_io import read_config
from engines.model.lora.adapters import ADAPTER_DIR
from engines.model.text.processor import VisionPromptError, is_vision_dir
from engines.model.text.tokenizer import TextTokenizer


class ServedModel:
    """The engine, its loop thread and its tokenizer (chat template included), as the HTTP handlers need them."""

    def __init__(self, model_dir: str | Path, name: str | None = None, dtype: str = "float32",
                 max_num_seqs: int = 256, kv_cache_bytes: int = 512 * 2**20, engine: str = "native",
                 tensor_parallel_size: int = 1, device: str | None = None, max_seq_len: int | None = None,
                 seed: int = 0, adapter: str | Path | None = None) -> None:
        """``engine``: native (this project's) or vllm (``tensor_parallel_size`` devices per replica); ``device``
        (native): cpu or cuda, by default cuda where there is one. ``adapter``: a PEFT LoRA adapter directory served
        on top of ``model_dir`` (its original base): merged into the native engine's weights, or vLLM's LoRA on
        every request. A LoRA run's ``final/`` is already merged: serve it without ``adapter``."""
        self.name = name or Path(model_dir).name
        if not is_vision_dir(model_dir):
            read_config(model_dir)  # a missing or unreadable model directory is named before its tokenizer
        own = Path(model_dir) / ADAPTER_DIR
        if adapter is not None and own.is_dir() and Path(adapter).resolve() == own.resolve():
            raise ValueError(f"{adapter} is already merged into {model_dir}'s weights (a LoRA run's final/ or "
                             "checkpoint): serve the directory without --adapter, or its base with --adapter")
        self.tokenizer = TextTokenizer.load(model_dir)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device cuda: CUDA is not available here (torch {torch.__version__}); use cpu")
        attention = decode_attention("auto", device) if engine == "native" else "torch"
        self.engine = build_engine(EngineSettings(
            kind=engine, model_dir=str(model_dir), device=device, dtype=dtype, fp8=False, max_seq_len=max_seq_len,
            max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes, max_batch_tokens=8192, attention=attention,
            seed=seed, tensor_parallel_size=tensor_parallel_size, adapter=None if adapter is None else str(adapter)),
            load_checkpoint=True)
        self.loop = EngineLoop(self.engine)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.hf.decode(ids, skip_special_tokens=True)

    def chat_ids(self, messages: list[ChatMessage]) -> tuple[list[int], tuple[ImageRef, ...]]:
        """Prompt ids of a chat request, and its images: the model's chat template (its processor's, for content
        parts with images), else plain role-prefixed turns."""
        if any(isinstance(m.content, list) for m in messages):
            return self._vision_ids(messages)
        if self.tokenizer.has_chat_template:
            return self.tokenizer.apply_chat_template([m.model_dump() for m in messages]), ()
        # no template shipped: plain role-prefixed turns, ending with the assistant's turn
        return self.encode("".join(f"{m.role.capitalize()}: {m.content}\n" for m in messages) + "Assistant:"), ()

    def _vision_ids(self, messages: list[ChatMessage]) -> tuple[list[int], tuple[ImageRef, ...]]:
        """Content parts: text parts as they are, each image part a placeholder of the model's processor."""
        images: list[ImageRef] = []
        rendered = []
        for i, m in enumerate(messages):
            if isinstance(m.content, str):
                rendered.append({"role": m.role, "content": m.content})
                continue
            parts = []
            for j, part in enumerate(m.content):
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text})
                else:
                    images.append(ImageRef.of(part.image_url.url, f"messages[{i}].content[{j}]"))
                    parts.append({"type": "image"})
            rendered.append({"role": m.role, "content": parts})
        if images and self.tokenizer.processor is None:
            raise InvalidRequestError(f"model {self.name} is a text-only model: it takes no images")
        if not self.engine.capabilities.multimodal_inputs and images:
            raise InvalidRequestError(f"the {self.engine.kind} engine takes no images; serve with --engine vllm")
        try:
            processor = self.tokenizer.processor
            ids = processor.render(rendered) if processor is not None else \
                self.tokenizer.apply_chat_template(rendered)
            if images:
                for im in images:
                    im.size()  # an image that does not decode is the request's error, named by its part
                processor.check(ids, images, "messages")
        except (ImageError, VisionPromptError) as e:
            raise InvalidRequestError(str(e)) from None
        return ids, tuple(images)

    def close(self) -> None:
        """Stop the loop thread and the engine."""
        self.loop.close()
        self.engine.close()


@dataclass
class Choice:
    """One choice of a response: its prompt and sampling parameters (``max_tokens`` 0: the prompt only)."""

    index: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    job: Submitted | None = None
    images: tuple = ()  # the prompt's (a vision-language model's chat request)


# --- requests --------------------------------------------------------------------------------


def _prompts(served: ServedModel, raw: str | list) -> list[list[int]]:
    if isinstance(raw, str):
        return [served.encode(raw)]
    if raw and all(isinstance(x, int) for x in raw):
        return [list(raw)]
    return [served.encode(x) if isinstance(x, str) else list(x) for x in raw]


def _choices(served: ServedModel, req: SamplingFields, prompts: list[list[int]], max_tokens: int | None,
             echo: bool, top: int | None) -> list[Choice]:
    """The request's choices, ``n`` per prompt (seeded requests get seed, seed+1, ... per sample); ``top``: the
    alternatives asked for, which an engine that can gives with each token."""
    if max_tokens == 0 and not echo:
        raise InvalidRequestError("max_tokens=0 generates nothing; it is allowed with echo=true, to score the prompt")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    out = []
    for prompt in prompts:
        budget = max_tokens
        if budget is None:  # the context's room
            budget = served.engine.max_seq_len - len(prompt)
            if budget < 1:
                raise InvalidRequestError(f"prompt has {len(prompt)} tokens and the model serves "
                                          f"{served.engine.max_seq_len} per sequence: no room for a completion")
        params = SamplingParams(temperature=req.temperature, max_tokens=max(budget, 1), top_p=req.top_p,
                                top_k=req.top_k, stop=stop, seed=req.seed, ignore_eos=req.ignore_eos,
                                top_logprobs=(top or 0) if served.engine.capabilities.step_top_logprobs else 0)
        for i in range(req.n):
            p = params if params.seed is None else replace(params, seed=params.seed + i)
            out.append(Choice(len(out), prompt, p, budget))
    return out


async def _submit(served: ServedModel, choices: list[Choice],
                  on_tokens: Callable[[int], Callable[[Progress], None]] | None = None) -> None:
    """Hand every choice that generates to the engine; returns once the engine took them (raising the
    InvalidRequestError of one it refused)."""
    for c in choices:
        if c.max_tokens:
            c.job = served.loop.submit(c.prompt, c.params, on_tokens(c.index) if on_tokens else None, c.images)
    for c in choices:
        if c.job is not None:
            await asyncio.wrap_future(c.job.accepted)


async def _completion(served: ServedModel, c: Choice) -> Completion:
    """The choice's completion (an empty one for the prompt alone)."""
    if c.job is None:
        return Completion([], [], "length", c.prompt, request_id=-1, params=c.params)
    return await asyncio.wrap_future(c.job.done)


async def _score(served: ServedModel, ids: list[int], top: int) -> list[TokenLogprob | None]:
    """Prompt log-probs of ``ids`` on the engine's thread (between steps)."""
    return await asyncio.wrap_future(served.loop.call(lambda: served.engine.prompt_logprobs(ids, top)))


def _trim(served: ServedModel, c: Completion, text: IncrementalText | None = None) -> Completion:
    """The completion without its stop string: the tokens (log-probs, alternatives) up to the last token boundary
    before the stop string, so that the text and the logprobs' tokens always agree (the stop string is in neither).
    ``text``: the completion's tokens already detokenized incrementally (a stream's); else they are here, once."""
    if not isinstance(c.stop_reason, str):
        return c
    if text is None:
        text = IncrementalText(served.decode)
        text.extend(c.token_ids)
    text.finish()
    keep = text.cut(c.stop_reason)
    if keep is None:
        return c
    tops = None if c.top_logprobs is None else c.top_logprobs[:keep]
    return replace(c, token_ids=c.token_ids[:keep], logprobs=c.logprobs[:keep], top_logprobs=tops)


def _usage(prompt_tokens: int, outs: list[Completion]) -> dict[str, int]:
    """Usage of a response: its prompts, each counted once however many samples it has (as OpenAI counts), and
    every generated token (those of a stop string included)."""
    c = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": c, "total_tokens": prompt_tokens + c}


# --- log-probs -------------------------------------------------------------------------------


@dataclass
class Piece:
    """Tokens of one choice with their log-probs (None: a first prompt token) and, when asked, the most likely
    tokens at each position (None where there is nothing before it)."""

    ids: list[int]
    values: list[float | None]
    tops: list[list[tuple[int, float]] | None] | None


async def _piece(served: ServedModel, prompt: list[int], tokens: list[int], logprobs: list[float],
                 alternatives: list[TopLogprobs | None] | None, start: int, end: int, top: int,
                 echo: bool = False) -> Piece:
    """Tokens ``start:end`` of a completion with their log-probs (the sampler's) and, when ``top`` > 0, the ``top``
    alternatives at each position: the engine's (``alternatives``, from its steps) or, where it gives none (None),
    those of a scoring forward of prompt and tokens; with ``echo`` the prompt's tokens first, with their log-probs
    under the model (a forward of the prompt alone, so they are the same whatever follows it, streamed or not)."""
    tops = None
    if top and alternatives is not None:
        tops = alternatives[start:end]
    elif top:
        scores = await _score(served, prompt + tokens[:end], top) if end > start else []
        tops = [s.top for s in scores[len(prompt) + start:]]
    piece = Piece(tokens[start:end], logprobs[start:end], tops)
    if not echo:
        return piece
    head = await _score(served, prompt, top)
    return Piece(prompt + piece.ids, [None if s is None else s.logprob for s in head] + piece.values,
                 None if tops is None else [None if s is None else s.top for s in head] + tops)


def _legacy(served: ServedModel, piece: Piece, offset: int) -> dict[str, Any]:
    """A completion's ``logprobs``: token texts, their log-probs, top alternatives and where each token's text
    begins in the choice's text (the first at ``offset``)."""
    tokens = [served.decode([t]) for t in piece.ids]
    tops = None if piece.tops is None else [
        None if alts is None else {served.decode([t]): v for t, v in alts} for alts in piece.tops]
    offsets = list(itertools.accumulate((len(x) for x in tokens[:-1]), initial=offset)) if tokens else []
    return {"tokens": tokens, "token_logprobs": piece.values, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(served: ServedModel, piece: Piece) -> dict[str, Any]:
    def entry(t: int, v: float) -> dict[str, Any]:
        text = served.decode([t])
        return {"token": text, "logprob": v, "bytes": list(text.encode())}

    tops = piece.tops or [[] for _ in piece.ids]
    return {"content": [{**entry(t, v), "top_logprobs": [entry(a, w) for a, w in alts or []]}
                        for t, v, alts in zip(piece.ids, piece.values, tops, strict=True)]}


# --- streaming -------------------------------------------------------------------------------


class TextStream:
    """What of one choice's tokens may be sent so far: whole tokens whose text can no longer turn into part of a
    stop string (the last ``hold`` characters wait) nor is a character cut in two, so that the pieces sent add up
    to the final, stop-string-trimmed text. The tokens arrive a step's worth at a time and their text is
    detokenized incrementally, so each step costs the same however long the stream."""

    def __init__(self, served: ServedModel, stop: tuple[str, ...]) -> None:
        self.text = IncrementalText(served.decode)
        self.hold = max(map(len, stop), default=1) - 1
        self.logprobs: list[float] = []
        self.alternatives: list[TopLogprobs | None] | None = None  # the engine's, when it gives them
        self.tokens = 0  # tokens sent

    @property
    def ids(self) -> list[int]:
        """Every token received so far."""
        return self.text.ids

    def add(self, tokens: list[int], logprobs: list[float], alternatives: list[TopLogprobs | None] | None) -> None:
        """Take the tokens generated since the last ones, with their log-probs and alternatives."""
        self.text.extend(tokens)
        self.logprobs.extend(logprobs)
        if alternatives is not None:
            self.alternatives = self.alternatives if self.alternatives is not None else []
            self.alternatives.extend(alternatives)

    def ready(self) -> int:
        """How many leading tokens may be sent now."""
        return max(self.tokens, self.text.boundary(self.text.length - self.hold))

    def advance(self, tokens: int) -> str:
        """Record the first ``tokens`` tokens (``ready``'s, or all of them, stop string cut) as sent; returns their
        new text."""
        delta = self.text.between(self.tokens, tokens)
        self.tokens = tokens
        return delta


def _events(served: ServedModel, choices: list[Choice]) -> tuple[asyncio.Queue, Callable]:
    """A queue of (choice index, ``Progress``, None) as a choice generates and (index, None, done future) when it
    ends, and the ``on_tokens`` maker that fills it from the engine's thread."""
    events: asyncio.Queue = asyncio.Queue()
    aloop = asyncio.get_running_loop()

    def on_tokens(index: int):
        return lambda progress: aloop.call_soon_threadsafe(events.put_nowait, (index, progress, None))

    return events, on_tokens


def _watch_done(choices: list[Choice], events: asyncio.Queue) -> None:
    aloop = asyncio.get_running_loop()
    for c in choices:
        if c.job is not None:
            c.job.done.add_done_callback(
                lambda f, i=c.index: aloop.call_soon_threadsafe(events.put_nowait, (i, None, f)))


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


Render = Callable[[Choice, str, "Piece | None", "str | None"], dict[str, Any]]


async def _stream(served: ServedModel, choices: list[Choice], events: asyncio.Queue, top: int | None,
                  render: Render, head: Callable[[Choice], AsyncIterator[dict[str, Any]]],
                  frame: Callable[[list, Any], dict], usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    """The server-sent events of a streamed response: ``head`` chunks of each choice, then each choice's pieces as
    it generates (``render``: choice, the new text, its tokens' log-probs when asked, finish reason), the usage
    chunk when asked, ``[DONE]``."""
    streams = {c.index: TextStream(served, c.params.stop) for c in choices}
    outs: list[Completion] = []
    for c in choices:
        async for chunk in head(c):
            yield _sse(frame([chunk], None))
    pending = {c.index for c in choices if c.job is not None}
    by_index = {c.index: c for c in choices}
    while pending:
        index, progress, done = await events.get()
        c, s = by_index[index], streams[index]
        if done is None:
            if index not in pending:
                continue
            s.add(progress.tokens, progress.logprobs, progress.top_logprobs)
            m = s.ready()
            if m > s.tokens:
                piece = None if top is None else await _piece(served, c.prompt, s.ids, s.logprobs, s.alternatives,
                                                               s.tokens, m, top)
                yield _sse(frame([render(c, s.advance(m), piece, None)], None))
            continue
        pending.discard(index)
        try:
            out = done.result()
        except Exception as e:  # the engine failed mid-way: say so in the stream, the others go on
            yield _sse({"error": {"message": f"generation failed: {e}", "type": "server_error", "param": None,
                                  "code": None}})
            continue
        outs.append(out)
        have = len(s.ids)  # the last step's tokens come with the completion, not as progress
        s.add(out.token_ids[have:], out.logprobs[have:],
              None if out.top_logprobs is None else out.top_logprobs[have:])
        s.text.finish()
        out = _trim(served, out, s.text)
        keep = len(out.token_ids)
        piece = None if top is None else await _piece(served, c.prompt, out.token_ids, out.logprobs,
                                                       out.top_logprobs, s.tokens, keep, top)
        yield _sse(frame([render(c, s.advance(keep), piece, out.finish_reason)], None))
    if usage:
        yield _sse(frame([], _usage(prompt_tokens, outs)))
    yield "data: [DONE]\n\n"


# --- the application -------------------------------------------------------------------------


def build_app(served: ServedModel) -> FastAPI:
    """The FastAPI application serving ``served``."""
    app = FastAPI(title="colocated-rl OpenAI-compatible server")

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error(400, f"{where}: {first.get('msg', 'invalid request')}" if where else str(exc), where)

    @app.exception_handler(InvalidRequestError)
    async def _bad_request(request: Request, exc: InvalidRequestError):
        return error(400, str(exc))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "owned_by": "colocated-rl",
                                            "created": 0}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    def unknown_model(name: str | None) -> JSONResponse | None:
        if name is None or name == served.name:
            return None
        return error(404, f"the model {name!r} does not exist; this server serves {served.name!r}", "model")

    def framer(kind: str, include_usage: bool) -> Callable[[list, Any], dict]:
        """Wraps a streamed response's choices (and, when asked, its usage: None until the last chunk)."""
        rid = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())

        def frame(choices: list, usage: Any) -> dict:
            body = {"id": rid, "object": kind, "created": created, "model": served.name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return body

        return frame

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if (bad := unknown_model(req.model)) is not None:
            return bad
        prompts = _prompts(served, req.prompt)
        k = req.logprobs
        choices = _choices(served, req, prompts, req.max_tokens, req.echo, k)
        prompt_tokens = sum(len(x) for x in prompts)
        if req.stream:
            events, on_tokens = _events(served, choices)
            await _submit(served, choices, on_tokens)
            _watch_done(choices, events)
            echoes = {id(p): await _piece(served, p, [], [], None, 0, 0, k, echo=True) for p in prompts} \
                if req.echo and k is not None else {}
            # text_offset counts as unstreamed: in the token texts (the echoed prompt's first), one after the other
            offsets = {c.index: sum(len(served.decode([t])) for t in c.prompt) if req.echo else 0 for c in choices}

            async def head(c: Choice) -> AsyncIterator[dict[str, Any]]:
                if req.echo:
                    yield {"index": c.index, "text": served.decode(c.prompt),
                           "logprobs": _legacy(served, echoes[id(c.prompt)], 0) if k is not None else None,
                           "finish_reason": None if c.job is not None else "length"}

            def render(c: Choice, text: str, piece: Piece | None, finish: str | None) -> dict[str, Any]:
                logprobs = None if piece is None else _legacy(served, piece, offsets[c.index])
                if logprobs is not None:
                    offsets[c.index] += sum(map(len, logprobs["tokens"]))
                return {"index": c.index, "text": text, "finish_reason": finish, "logprobs": logprobs}

            return StreamingResponse(
                _stream(served, choices, events, k, render, head, framer("text_completion", req.include_usage),
                        req.include_usage, prompt_tokens), media_type="text/event-stream")
        await _submit(served, choices)
        outs = [await _completion(served, c) for c in choices]
        body = []
        for c, o in zip(choices, outs, strict=True):
            t = _trim(served, o)
            lp = None
            if k is not None:
                lp = _legacy(served, await _piece(served, c.prompt, t.token_ids, t.logprobs, t.top_logprobs, 0,
                                                  len(t.token_ids), k, req.echo), 0)
            body.append({"index": c.index, "finish_reason": t.finish_reason, "logprobs": lp,
                         "text": (served.decode(c.prompt) if req.echo else "") + served.decode(t.token_ids)})
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": served.name, "choices": body, "usage": _usage(prompt_tokens, outs)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        if (bad := unknown_model(req.model)) is not None:
            return bad
        if req.top_logprobs and not req.logprobs:
            return error(400, "top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens == 0:
            return error(400, "max_tokens must be at least 1 (a chat completion has no echo)", "max_tokens")
        try:
            prompt, images = served.chat_ids(req.messages)
        except InvalidRequestError as e:
            return error(400, str(e), "messages")
        top = (req.top_logprobs or 0) if req.logprobs else None
        choices = _choices(served, req, [prompt], max_tokens, echo=False, top=top)
        for c in choices:
            c.images = images
        if req.stream:
            events, on_tokens = _events(served, choices)
            await _submit(served, choices, on_tokens)
            _watch_done(choices, events)

            async def head(c: Choice) -> AsyncIterator[dict[str, Any]]:
                yield {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None}

            def render(c: Choice, text: str, piece: Piece | None, finish: str | None) -> dict[str, Any]:
                return {"index": c.index, "delta": {"content": text} if text or finish is None else {},
                        "logprobs": None if piece is None else _chat_logprobs(served, piece), "finish_reason": finish}

            return StreamingResponse(
                _stream(served, choices, events, top, render, head, framer("chat.completion.chunk",
                                                                           req.include_usage),
                        req.include_usage, len(prompt)), media_type="text/event-stream")
        await _submit(served, choices)
        outs = [await _completion(served, c) for c in choices]
        body = []
        for c, o in zip(choices, outs, strict=True):
            t = _trim(served, o)
            lp = None
            if top is not None:
                lp = _chat_logprobs(served, await _piece(served, c.prompt, t.token_ids, t.logprobs, t.top_logprobs, 0,
                                                         len(t.token_ids), top))
            body.append({"index": c.index, "message": {"role": "assistant", "content": served.decode(t.token_ids)},
                         "finish_reason": t.finish_reason, "logprobs": lp})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": served.name, "choices": body, "usage": _usage(len(prompt), outs)}

    return app


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8000, **kw: Any) -> None:
    """Load ``model_dir`` (with ``adapter=``: plus that PEFT LoRA adapter) and serve it until interrupted; ``kw``
    are ``ServedModel``'s."""
    import uvicorn

    served = ServedModel(model_dir, **kw)
    try:
        uvicorn.run(build_app(served), host=host, port=port, log_level="info")
    finally:
        served.close()
