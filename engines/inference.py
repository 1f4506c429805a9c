"""The native inference engine: continuous batching over a slot KV cache, for rollouts and serving.

Requests join the running batch as soon as a slot is free and leave it the step they finish.
Requests with the same prompt share one prefill (the K samples of a K1.5 group). Each step
samples one token for every running request in one batched call; per-request Python runs only
when a request joins or finishes. Returned logprobs are log softmax(logits / T) of the sampled
tokens: the π_old of the K1.5 objective. ``pause``/``resume`` carry unfinished requests across a
weight update (partial rollout); ``sleep``/``wake_up`` free the KV cache and weights while the
trainer runs on the same device. Weights are replaced in place by the checkpoint engine.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engines.cuda_graphs import DecodeGraphs
from engines.kv_cache import DecodePass, PrefillPass, SlotKVCache, bytes_per_slot
from engines.layout import hub_state, model_tensors
from engines.model import CausalLM, padded_causal_mask, positions_from_valid
from engines.sampling import (
    InvalidRequestError,
    RowParams,
    SamplingParams,
    advance_matchers,
    mask_logits,
    new_matcher,
    sample,
    token_logprobs,
)

__all__ = ["Completion", "InferenceEngine", "InvalidRequestError", "SamplingParams", "token_logprobs"]

#: Most stop token ids one request may name (besides EOS).
MAX_STOP_IDS = 16


@dataclass
class Completion:
    """One response. ``finish_reason``: "stop" (EOS, stop token or stop string, named in
    ``stop_reason``), "length" (token budget), "error" (``error`` says why) or None (paused)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    prompt_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    error: str | None = None
    request_id: int = -1
    params: SamplingParams | None = None


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    prior: list[int] = field(default_factory=list)  # tokens generated before a pause
    prior_logprobs: list[float] = field(default_factory=list)
    matcher: Any = None  # per-sequence grammar state when params.grammar is set (engines.constrained)


class InferenceEngine:
    """Continuous-batching generation with a preallocated slot KV cache.

    ``kv_cache_bytes`` is the memory budget of the cache; it holds ``min(max_num_seqs, budget //
    bytes per sequence)`` sequences of up to ``max_seq_len`` tokens (prompt + response).
    ``detokenize`` turns token ids into text; it is needed only for stop strings.
    """

    def __init__(self, model: CausalLM, eos_id: int | Sequence[int] | None, pad_id: int | None = None, *,
                 max_seq_len: int | None = None, kv_cache_bytes: int = 512 * 2**20, max_num_seqs: int = 512,
                 max_prefill_tokens: int = 8192, seed: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None, cuda_graphs: bool = True) -> None:
        self.model = model.eval().requires_grad_(False)
        cfg = model.config
        # a model may end a turn with any of several tokens (Llama 3: <|eot_id|> and <|end_of_text|>)
        self.eos_ids = [] if eos_id is None else [int(eos_id)] if isinstance(eos_id, int) else [int(e) for e in eos_id]
        self.pad_id = pad_id if pad_id is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.max_seq_len = max_seq_len or cfg.max_position_embeddings
        if self.max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the model's context "
                             f"{cfg.max_position_embeddings}")
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        per_slot = bytes_per_slot(cfg, self.max_seq_len, self.dtype)
        self.slots = min(max_num_seqs, kv_cache_bytes // per_slot)
        if self.slots < 1:
            raise ValueError(f"a KV cache budget of {kv_cache_bytes} bytes holds no sequence of {self.max_seq_len} "
                             f"tokens ({per_slot} bytes each); raise kv_cache_bytes or lower max_seq_len")
        self.kv_cache_bytes = self.slots * per_slot
        self.max_prefill_tokens = max_prefill_tokens
        self.detokenize = detokenize
        self._seed = seed
        self._ids = itertools.count()
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []  # running[i] sits in slot i
        self.kv: SlotKVCache | None = None
        self._sleep_level = 0
        self._weights_loaded = True
        self._offloaded: dict[str, tuple] = {}
        self._n_constrained = 0  # running requests with a grammar; 0 keeps the batched path free of Python loops
        self.graphs = DecodeGraphs(self) if cuda_graphs and self.device.type == "cuda" else None
        self._alloc_state()

    # --- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, prior: Sequence[int] = (),
                    prior_logprobs: Sequence[float] = (), request_id: int | None = None) -> int:
        """Queue a request; raises InvalidRequestError (and queues nothing) if it cannot be served.

        ``prior``/``prior_logprobs`` are tokens already generated for it (a resumed request).
        """
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = [int(t) for t in prompt_ids]
        vocab, ctx = self.model.config.vocab_size, self.model.config.max_position_embeddings
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt) + params.max_tokens > ctx:
            raise InvalidRequestError(f"prompt has {len(prompt)} tokens; with max_tokens={params.max_tokens} it "
                                      f"exceeds the model's context of {ctx} tokens")
        if len(prompt) + params.max_tokens > self.max_seq_len:
            raise InvalidRequestError(
                f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} does not fit the KV cache, "
                f"which holds {self.max_seq_len} tokens per sequence (max_seq_len)")
        if len(prior) != len(prior_logprobs) or len(prior) >= params.max_tokens:
            raise InvalidRequestError(f"resumed request has {len(prior)} tokens and {len(prior_logprobs)} logprobs "
                                      f"for max_tokens={params.max_tokens}")
        if params.stop and self.detokenize is None:
            raise InvalidRequestError("stop strings need an engine built with a detokenize function")
        if len(params.stop_token_ids) > MAX_STOP_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_IDS} stop_token_ids, got {len(params.stop_token_ids)}")
        matcher = new_matcher(params, prior)
        rid = next(self._ids) if request_id is None else request_id
        seed = params.seed if params.seed is not None else (self._seed * 1_000_003 + rid) % 2**63
        self.waiting.append(_Request(rid, prompt, params, seed, list(prior), list(prior_logprobs), matcher))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 seed: int | None = None, on_finish: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Run prompts to completion; results keep the prompts' order. A request that cannot be
        served gets finish_reason "error" and its reason, and the others still run. ``seed`` seeds
        the requests without their own seed by their index in this call (reproducible batches)."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        if seed is not None:
            plist = [p if p.seed is not None else replace(p, seed=(seed * 1_000_003 + i) % 2**63)
                     for i, p in enumerate(plist)]
        out: dict[int, Completion] = {}
        order = []
        for prompt, p in zip(prompts, plist, strict=True):
            try:
                order.append(self.add_request(prompt, p))
            except InvalidRequestError as e:
                rid = next(self._ids)
                order.append(rid)
                out[rid] = Completion([], [], "error", list(prompt), error=str(e), request_id=rid, params=p)
        while self.has_unfinished():
            for c in self.step():
                out[c.request_id] = c
                if on_finish:
                    on_finish(c)
        return [out[r] for r in order]

    def step(self) -> list[Completion]:
        """Decode one token for every running request, admit waiting ones; returns finished ones."""
        self._check_awake()
        finished: list[int] = []
        if self.running:
            finished += self._decode()
        if self.waiting and len(self.running) < self.slots:
            finished += self._admit()
        return self._release(finished)

    def pause(self) -> list[Completion]:
        """Stop every unfinished request; returns them (finish_reason None) with tokens so far."""
        out = [self._completion(r, i, None) for i, r in enumerate(self.running)]
        out += [Completion(list(r.prior), list(r.prior_logprobs), None, r.prompt, request_id=r.id, params=r.params)
                for r in self.waiting]
        self.running.clear()
        self.waiting.clear()
        self._n_constrained = 0
        return out

    def resume(self, partials: Iterable[Completion]) -> list[int]:
        """Continue paused requests from their tokens (after a weight update their prefix is
        recomputed with the new weights); the sampling stream continues where it stopped."""
        ids = []
        for c in partials:
            if c.finish_reason is not None or c.params is None:
                raise InvalidRequestError(f"request {c.request_id} is not a paused request")
            ids.append(self.add_request(c.prompt_ids, c.params, prior=c.token_ids, prior_logprobs=c.logprobs,
                                        request_id=c.request_id))
        return ids

    # --- colocation -----------------------------------------------------------------------

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors the checkpoint engine writes into, by the model's names (each storage once)."""
        return model_tensors(self.model)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1; on an accelerator the weights also move to host memory)
        or the KV cache and the weights (level 2: weights must be loaded again after ``wake_up``)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.has_unfinished():
            raise RuntimeError(f"{len(self.running) + len(self.waiting)} requests unfinished; pause() them "
                               "before sleep()")
        self.kv = None
        if self.graphs is not None:  # their memory pool goes too
            self.graphs.clear()
        self._alloc_state(free=True)
        for name, t in self.named_tensors().items():
            if level == 2:
                self._offloaded[name] = (t.shape, t.dtype, None)
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            elif t.device.type != "cpu":
                self._offloaded[name] = (t.shape, t.dtype, t.data.to("cpu").pin_memory())
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self._sleep_level = level
        if level == 2:
            self._weights_loaded = False

    def wake_up(self) -> None:
        """Reallocate what ``sleep`` freed (level-2 weights come back uninitialised)."""
        for name, t in self.named_tensors().items():
            if name in self._offloaded:
                shape, dtype, host = self._offloaded.pop(name)
                fresh = torch.empty(shape, dtype=dtype, device=self.device) if host is None else host.to(self.device)
                t.data = fresh
        self._alloc_state()
        self._sleep_level = 0

    @property
    def sleeping(self) -> int:
        """0 when awake, else the level of the last ``sleep``."""
        return self._sleep_level

    def weights_loaded(self) -> None:
        """Declare the weights valid again after a level-2 sleep (a complete update arrived)."""
        self._weights_loaded = True

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the engine's weights by their checkpoint names (e.g. from a safetensors
        file), whatever the engine's own layout."""
        mine = hub_state(self.model)
        for name, t in tensors:
            if name not in mine or mine[name].shape != t.shape:
                raise ValueError(f"no weight {name} of shape {tuple(t.shape)} in the inference engine")
            mine[name].copy_(t)
        self._weights_loaded = True

    # --- internals ------------------------------------------------------------------------

    def _check_awake(self) -> None:
        if self._sleep_level:
            raise RuntimeError("inference engine is asleep; call wake_up() first")
        if not self._weights_loaded:
            raise RuntimeError("weights were discarded by sleep(level=2); load weights before generating")

    def _alloc_state(self, free: bool = False) -> None:
        s, w, dev = (0, 0, self.device) if free else (self.slots, self.max_seq_len, self.device)
        z = dict(dtype=torch.long, device=dev)
        self.pos, self.last, self.gen, self.max_gen = (torch.zeros(s, **z) for _ in range(4))
        self.stop_ids = torch.full((s, MAX_STOP_IDS), -1, **z)
        self.eos_stop = torch.zeros(s, dtype=torch.bool, device=dev)
        self._eos = torch.tensor(self.eos_ids, **z)
        self.has_stop_str = torch.zeros(s, dtype=torch.bool, device=dev)
        self.rows = RowParams(torch.zeros(s, device=dev), torch.zeros(s, **z), torch.ones(s, device=dev),
                              torch.zeros(s, **z))
        self.out_tokens = torch.zeros(s, w, **z)
        self.out_logprobs = torch.zeros(s, w, device=dev)

    def _cache(self) -> SlotKVCache:
        if self.kv is None:
            self.kv = SlotKVCache(self.model.config, self.slots, self.max_seq_len, self.dtype, self.device)
        return self.kv

    def _decode(self) -> list[int]:
        n = len(self.running)
        logits = self.graphs.logits(n) if self.graphs is not None else self.decode_logits(n)
        self.pos[:n] += 1
        return self._commit(torch.arange(n, device=self.device), logits)

    def decode_logits(self, rows: int, width: int | None = None) -> torch.Tensor:
        """Next-token logits [rows, V] of slots 0..rows-1 from their last token, writing its key/value
        into the cache; ``width`` fixes the attention span (the CUDA graphs' static shapes)."""
        pos = self.pos[:rows]
        return self.model(self.last[:rows, None], pos[:, None], cache=DecodePass(self._cache(), pos, width))[:, -1]

    def _admit(self) -> list[int]:
        """Prefill waiting requests into free slots (one prefill per distinct sequence) and sample
        their first token."""
        cache, admitted = self._cache(), []
        while self.waiting and len(self.running) < self.slots:
            r = self.waiting.popleft()
            slot = len(self.running)
            self.running.append(r)
            self._set_slot(slot, r)
            admitted.append(slot)
        groups: dict[tuple[int, ...], list[int]] = {}
        for slot in admitted:
            r = self.running[slot]
            groups.setdefault(tuple(r.prompt + r.prior), []).append(slot)
        seqs = list(groups)
        finished, start = [], 0
        while start < len(seqs):
            # chunk by padded tokens so one prefill never allocates more than max_prefill_tokens rows
            end, width = start, 0
            while end < len(seqs) and (end == start or max(width, len(seqs[end])) * (end + 1 - start)
                                       <= self.max_prefill_tokens):
                width = max(width, len(seqs[end]))
                end += 1
            chunk = seqs[start:end]
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            valid = torch.zeros(len(chunk), width, dtype=torch.bool)
            for i, s in enumerate(chunk):
                ids[i, : len(s)] = torch.tensor(s)
                valid[i, : len(s)] = True
            ids, valid = ids.to(self.device), valid.to(self.device)
            mask = padded_causal_mask(valid)
            positions = positions_from_valid(valid)
            capture = PrefillPass(mask, positions)
            lengths = valid.sum(-1)
            logits = self.model(ids, positions, mask, cache=capture, select=lengths - 1)
            src = [i for i, s in enumerate(chunk) for _ in groups[s]]
            dst = torch.tensor([slot for s in chunk for slot in groups[s]], device=self.device)
            src_t = torch.tensor(src, device=self.device)
            for layer, (k, v) in enumerate(zip(capture.k, capture.v, strict=True)):
                cache.store_prefill(layer, dst, k[src_t], v[src_t])
            self.pos[dst] = lengths[src_t]
            finished += self._commit(dst, logits[src_t])
            start = end
        return finished

    def _set_slot(self, slot: int, r: _Request) -> None:
        p, g = r.params, len(r.prior)
        self.gen[slot], self.max_gen[slot] = g, p.max_tokens
        if g:
            self.out_tokens[slot, :g] = torch.tensor(r.prior)
            self.out_logprobs[slot, :g] = torch.tensor(r.prior_logprobs)
        self.eos_stop[slot] = not p.ignore_eos
        self.stop_ids[slot] = -1
        if p.stop_token_ids:
            self.stop_ids[slot, : len(p.stop_token_ids)] = torch.tensor(p.stop_token_ids)
        self.has_stop_str[slot] = bool(p.stop)
        self.rows.temperature[slot], self.rows.top_k[slot] = p.temperature, p.top_k
        self.rows.top_p[slot], self.rows.seed[slot] = p.top_p, r.seed
        self._n_constrained += r.matcher is not None

    def _commit(self, slots: torch.Tensor, logits: torch.Tensor) -> list[int]:
        """Sample the next token of ``slots`` from ``logits``, record it; returns the slots that finished."""
        gen = self.gen[slots]
        if self._n_constrained:
            # logprobs are then those of the masked distribution, the one the tokens are drawn from
            logits = mask_logits(logits, self._matchers(slots))
        tok, lp = sample(logits, self.rows[slots], gen)
        self.out_tokens[slots, gen] = tok
        self.out_logprobs[slots, gen] = lp.float()
        self.last[slots] = tok
        self.gen[slots] = gen + 1
        done = (torch.isin(tok, self._eos) & self.eos_stop[slots]) | (self.stop_ids[slots] == tok[:, None]).any(1)
        done |= gen + 1 >= self.max_gen[slots]
        if self._n_constrained:
            done |= advance_matchers(self._matchers(slots), tok)
        check = self.has_stop_str[slots] & ~done
        finished = slots[done].tolist()
        if bool(check.any()):
            finished += [s for s in slots[check].tolist() if self._stop_string(s) is not None]
        return finished

    def _stop_string(self, slot: int) -> str | None:
        r, g = self.running[slot], int(self.gen[slot])
        longest = max(map(len, r.params.stop))
        # a token is at least one byte, so the last `longest` tokens (+1 for a split character) hold any new match
        tail = self.detokenize(self.out_tokens[slot, max(0, g - longest - 1) : g].tolist())
        return next((s for s in r.params.stop if s in tail), None)

    def _completion(self, r: _Request, slot: int, reason: str | None,
                    stop_reason: int | str | None = None) -> Completion:
        g = int(self.gen[slot])
        return Completion(self.out_tokens[slot, :g].tolist(), self.out_logprobs[slot, :g].tolist(), reason,
                          r.prompt, stop_reason=stop_reason, request_id=r.id, params=r.params)

    def _stop_reason(self, r: _Request, slot: int) -> int | str | None:
        """What stopped a finished request: a stop token id (EOS included), a stop string, or None."""
        tok = int(self.out_tokens[slot, int(self.gen[slot]) - 1])
        if tok in r.params.stop_token_ids or (tok in self.eos_ids and not r.params.ignore_eos):
            return tok
        if r.matcher is not None and r.matcher.is_terminated():
            return tok  # the grammar's stop token ended it (even with ignore_eos)
        return self._stop_string(slot) if r.params.stop else None

    def _release(self, finished: list[int]) -> list[Completion]:
        out = []
        for slot in sorted(set(finished), reverse=True):
            r = self.running[slot]
            why = self._stop_reason(r, slot)
            out.append(self._completion(r, slot, "length" if why is None else "stop", why))
            self._n_constrained -= r.matcher is not None
            self._move(len(self.running) - 1, slot)
            self.running.pop()
        return out[::-1]

    def _move(self, src: int, dst: int) -> None:
        """Fill slot ``dst`` with the request in slot ``src`` (keeps the running slots contiguous)."""
        if src == dst:
            return
        self.running[dst] = self.running[src]
        g, p = int(self.gen[src]), int(self.pos[src])
        if self.kv is not None:
            self.kv.move(src, dst, p)
        for t in (self.pos, self.last, self.gen, self.max_gen, self.stop_ids, self.eos_stop, self.has_stop_str,
                  self.rows.temperature, self.rows.top_k, self.rows.top_p, self.rows.seed):
            t[dst] = t[src]
        self.out_tokens[dst, :g] = self.out_tokens[src, :g]
        self.out_logprobs[dst, :g] = self.out_logprobs[src, :g]

    # --- constrained decoding (SamplingParams.grammar) -------------------------------------

    def _matchers(self, slots: torch.Tensor) -> list[Any]:
        return [self.running[s].matcher for s in slots.tolist()]
