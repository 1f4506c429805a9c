"""An OpenAI-compatible HTTP server over the inference engine (``rl serve MODEL_DIR``).

``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, so a checkpoint can be evaluated
with the usual clients (the ``openai`` package, lm-eval's ``local-completions``...). One thread owns
the engine and steps it while requests are pending; concurrent HTTP requests join the same running
batch (continuous batching) and the ``n`` samples of one request share their prompt's prefill.
A request the engine cannot serve gets a 400 with the reason; the others are not affected.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from engines.inference.base import RolloutEngine
from engines.inference.native import InferenceEngine
from engines.inference.requests import Completion
from engines.inference.sampling import InvalidRequestError, SamplingParams
from engines.model.attention import padded_causal_mask, positions_from_valid
from engines.model.hf_io import load_pretrained, read_config
from engines.model.tokenizer import TextTokenizer

MAX_TOP_LOGPROBS = 20


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields (user, presence_penalty=0...) are ignored

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = Field(1, ge=1, le=256)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    ignore_eos: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # also the number of top alternatives
    echo: bool = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = None


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=status)


class EngineLoop:
    """Owns the engine on one thread; ``submit`` is safe from any thread."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        fut: Future = Future()
        self._inbox.put((prompt, params, fut))
        return fut

    def call(self, fn) -> Future:
        """Run ``fn()`` on the engine's thread between steps (the model is never used by two threads at once)."""
        fut: Future = Future()
        self._inbox.put((fn, None, fut))
        return fut

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _take(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            prompt, params, fut = item
            if params is None:  # a function to run here (top log-probabilities)
                try:
                    fut.set_result(prompt())
                except Exception as e:
                    fut.set_exception(e)
                continue
            try:
                self._futures[self.engine.add_request(prompt, params)] = fut
            except InvalidRequestError as e:
                fut.set_exception(e)

    def _run(self) -> None:
        # a new thread's current CUDA device is the first one, not necessarily the engine's
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)
        while not self._stop.is_set():
            self._take(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                continue
            try:
                done = self.engine.step()
            except Exception as e:  # a failing step fails its requests, not the server
                for c in self.engine.pause():
                    self._futures.pop(c.request_id).set_exception(e)
                continue
            for c in done:
                self._futures.pop(c.request_id).set_result(c)


class ServedModel:
    """The engine and its tokenizer (chat template included), as the HTTP handlers need them."""

    def __init__(self, model_dir: str | Path, name: str | None = None, dtype: str = "float32",
                 max_num_seqs: int = 256, kv_cache_bytes: int = 512 * 2**20, engine: str = "native",
                 tensor_parallel_size: int = 1) -> None:
        """``engine``: native (this project's) or vllm (``tensor_parallel_size`` devices per replica)."""
        self.name = name or Path(model_dir).name
        read_config(model_dir)  # a missing or unreadable model directory is named before its tokenizer
        self.tokenizer = TextTokenizer.load(model_dir)
        if engine == "vllm":
            from engines.inference.vllm_engine import VllmEngine

            self.engine = VllmEngine(model_dir, self.tokenizer.eos_ids, dtype=dtype, max_num_seqs=max_num_seqs,
                                     kv_cache_bytes=kv_cache_bytes, tensor_parallel_size=tensor_parallel_size)
            self.device = self.engine.device
        elif engine == "native":
            if tensor_parallel_size != 1:
                raise ValueError(f"tensor parallel size {tensor_parallel_size} needs the vllm engine")
            model = load_pretrained(model_dir, getattr(torch, dtype))
            self.device = next(model.parameters()).device
            self.engine = InferenceEngine(model, self.tokenizer.eos_ids, self.tokenizer.pad_id,
                                          max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes,
                                          detokenize=self.decode)
        else:
            raise ValueError(f"engine must be native or vllm, got {engine!r}")
        self.default_max_tokens = 16
        self.loop = EngineLoop(self.engine)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.hf.decode(ids, skip_special_tokens=True)

    def chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        """Prompt ids of a chat request: the model's chat template, else plain role-prefixed turns."""
        if self.tokenizer.has_chat_template:
            return self.tokenizer.apply_chat_template([m.model_dump() for m in messages])
        # no template shipped: plain role-prefixed turns, ending with the assistant's turn
        return self.encode("".join(f"{m.role.capitalize()}: {m.content}\n" for m in messages) + "Assistant:")


def _params(req: _Sampling, served: ServedModel, max_tokens: int | None) -> SamplingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(temperature=req.temperature, max_tokens=max_tokens or served.default_max_tokens,
                          top_p=req.top_p, top_k=req.top_k, stop=stop, seed=req.seed, ignore_eos=req.ignore_eos)


def _trim(served: ServedModel, c: Completion) -> Completion:
    """The completion without its stop string: the tokens (and log-probs) up to the last one that ends before the
    stop string, so that the text and the logprobs' tokens always agree (the stop string is in neither)."""
    if not isinstance(c.stop_reason, str):
        return c
    end = served.decode(c.token_ids).find(c.stop_reason)
    if end < 0:
        return c
    keep = len(c.token_ids)
    while keep and len(served.decode(c.token_ids[:keep])) > end:
        keep -= 1
    return replace(c, token_ids=c.token_ids[:keep], logprobs=c.logprobs[:keep])


def _top_logprobs(served: ServedModel, c: Completion, k: int) -> list[list[tuple[int, float]]]:
    """The ``k`` most likely tokens and their log-probabilities at each position of the completion (the model's
    own distribution, before temperature), from one forward pass on the engine's thread."""
    if not k or not c.token_ids:
        return [[] for _ in c.token_ids]
    if served.engine.kind != "native":
        raise InvalidRequestError("top_logprobs: served by the native engine only (rl serve --engine native)")

    def score() -> list[list[tuple[int, float]]]:
        ids = torch.tensor([c.prompt_ids + c.token_ids], device=served.device)
        valid = torch.ones_like(ids, dtype=torch.bool)
        with torch.no_grad():
            logits = served.engine.model(ids, positions_from_valid(valid), padded_causal_mask(valid))
        lp = torch.log_softmax(logits[0, len(c.prompt_ids) - 1:-1].float(), dim=-1)
        values, indices = lp.topk(min(k, lp.shape[-1]), dim=-1)
        return [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(indices, values, strict=True)]

    return served.loop.call(score).result()


async def _run_all(served: ServedModel, prompts: list[list[int]], params: SamplingParams, n: int) -> list[Completion]:
    """Submit n samples of each prompt (seeded requests get seed, seed+1, ... per sample)."""
    futs = []
    for prompt in prompts:
        for i in range(n):
            p = params if params.seed is None else replace(params, seed=params.seed + i)
            futs.append(asyncio.wrap_future(served.loop.submit(prompt, p)))
    return list(await asyncio.gather(*futs))


def _usage(prompts: list[list[int]], outs: list[Completion]) -> dict[str, int]:
    p = sum(len(x) for x in prompts)  # each prompt once, however many samples it has (as OpenAI counts)
    c = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def build_app(served: ServedModel) -> FastAPI:
    """The FastAPI application serving ``served``."""
    app = FastAPI(title="colocated-rl OpenAI-compatible server")

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}" if where else str(exc), where)

    @app.exception_handler(InvalidRequestError)
    async def _bad_request(request: Request, exc: InvalidRequestError):
        return _error(400, str(exc))

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
        return _error(404, f"the model {name!r} does not exist; this server serves {served.name!r}", "model")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if (bad := unknown_model(req.model)) is not None:
            return bad
        if req.stream:
            return _error(400, "stream=true is not supported; send the request without streaming", "stream")
        raw = req.prompt
        if isinstance(raw, str):
            prompts = [served.encode(raw)]
        elif raw and all(isinstance(x, int) for x in raw):
            prompts = [list(raw)]  # type: ignore[arg-type]
        else:
            prompts = [served.encode(x) if isinstance(x, str) else list(x) for x in raw]  # type: ignore[union-attr]
        outs = await _run_all(served, prompts, _params(req, served, req.max_tokens), req.n)
        choices = []
        for i, o in enumerate(outs):
            o = _trim(served, o)
            text = served.decode(o.token_ids)
            choice: dict[str, Any] = {"index": i, "text": (served.decode(o.prompt_ids) + text) if req.echo else text,
                                      "finish_reason": o.finish_reason, "logprobs": None}
            if req.logprobs is not None:
                tokens = [served.decode([t]) for t in o.token_ids]
                top = None
                if req.logprobs > 0:
                    top = [{served.decode([t]): v for t, v in alts}
                           for alts in await asyncio.to_thread(_top_logprobs, served, o, req.logprobs)]
                offsets = [sum(len(x) for x in tokens[:j]) for j in range(len(tokens))]
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": o.logprobs, "top_logprobs": top,
                                      "text_offset": offsets}
            choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": served.name, "choices": choices, "usage": _usage(prompts, outs)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        if (bad := unknown_model(req.model)) is not None:
            return bad
        if req.top_logprobs and not req.logprobs:
            return _error(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if req.stream:
            return _error(400, "stream=true is not supported; send the request without streaming", "stream")
        prompt = served.chat_ids(req.messages)
        outs = await _run_all(served, [prompt], _params(req, served, req.max_completion_tokens or req.max_tokens),
                              req.n)
        choices = []
        for i, o in enumerate(outs):
            o = _trim(served, o)
            lp = None
            if req.logprobs:
                top = await asyncio.to_thread(_top_logprobs, served, o, req.top_logprobs or 0)

                def entry(t: int, v: float) -> dict[str, Any]:
                    text = served.decode([t])
                    return {"token": text, "logprob": v, "bytes": list(text.encode())}

                lp = {"content": [{**entry(t, v), "top_logprobs": [entry(a, w) for a, w in alts]}
                                  for t, v, alts in zip(o.token_ids, o.logprobs, top, strict=True)]}
            choices.append({"index": i, "message": {"role": "assistant", "content": served.decode(o.token_ids)},
                            "finish_reason": o.finish_reason, "logprobs": lp})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": served.name, "choices": choices, "usage": _usage([prompt], outs)}

    return app


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8000, **kw: Any) -> None:
    """Load ``model_dir`` and serve it until interrupted."""
    import uvicorn

    served = ServedModel(model_dir, **kw)
    try:
        uvicorn.run(build_app(served), host=host, port=port, log_level="info")
    finally:
        served.loop.close()
        if hasattr(served.engine, "close"):
            served.engine.close()
