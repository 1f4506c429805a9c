"""The native inference engine: continuous batching over a paged KV cache, for rollouts and serving.

Each step runs one forward over a flat batch of tokens: one per decoding request plus prompt chunks
(``engines.inference.scheduler`` picks them under a token budget, so a long prompt never stalls decoding). Keys
and values live in fixed-size blocks (``engines.inference.kv_cache``): a sequence takes blocks as it grows, the K
samples of a prompt share the prompt's blocks, and any later request with a cached prefix reuses it.
Every decoding row samples its next token in one batched call; the host reads the step's tokens once.
Returned logprobs are log softmax(logits / T) of the sampled tokens: the π_old of the K1.5 objective.
``pause``/``resume`` carry unfinished requests across a weight update (partial rollout); while the
weights are unchanged a resumed request finds its full blocks still cached. ``sleep``/``wake_up``
free the KV cache and weights while the trainer runs on the same device; both live in arenas
(``engines.inference.colocation``) whose addresses survive the sleep, so captured CUDA graphs are kept. An update
of the weights must be declared (``weights_loaded``) so cached prefixes computed with the old weights are
dropped.

A step goes one way, as in vLLM's engine core: the scheduler plans it (``StepPlan``), the model runner
(``engines.inference.model_runner``) executes the plan and returns the sampled tokens (``StepOutput``), and this
engine records them: tokens and log-probs onto the requests, blocks into the prefix cache, stop strings and
grammars checked, finished requests released.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from engines.device import host_buffer
from engines.inference import cpu_linear
from engines.inference.base import RolloutEngine
from engines.inference.blocks import BlockAllocator
from engines.inference.capabilities import NATIVE
from engines.inference.colocation import EngineMemory, fit_kv_budget, free_device_bytes
from engines.inference.cuda_graphs import graphs_supported
from engines.inference.kv_cache import BLOCK_SIZE, PagedKVCache, bytes_per_token, decode_attention, paged_pool
from engines.inference.model_runner import ModelRunner, StepOutput
from engines.inference.requests import Completion, Progress, Request, TokenLogprob, check_prompt, check_request
from engines.inference.sampling import (
    InvalidRequestError,
    SamplingParams,
    advance_matchers,
    filter_kind,
    new_matcher,
    token_logprobs,
)
from engines.inference.scheduler import Scheduler, StepPlan
from engines.model.layout import byte_placements, hub_state, model_tensors, placements
from engines.model.lora.adapters import AdapterMerger, adapter_pairs, merge_adapters_into
from engines.model.lora.delta import LowRankDelta
from engines.model.native.causal_lm import CausalLM
from engines.model.native.compile import compile_layers

__all__ = ["Completion", "InferenceEngine", "InvalidRequestError", "SamplingParams", "fit_kv_budget",
           "token_logprobs"]

#: Tokens per KV block with flex attention (its block masks work in tiles of this size).
FLEX_BLOCK_SIZE = 128


class InferenceEngine(RolloutEngine):
    """Continuous-batching generation over a paged KV cache.

    ``kv_cache_bytes`` is the cache's memory budget, cut into blocks of ``block_size`` tokens; it must
    hold at least one sequence of ``max_seq_len`` tokens (prompt + response, default the model's
    context). At most ``max_num_seqs`` sequences decode at once; a step computes at most
    ``max_batch_tokens`` tokens (decode rows first, then prompt chunks). ``detokenize`` turns token
    ids into text; it is needed only for stop strings. ``attention``: "torch" (gathering), "flex"
    (flex_attention through block masks, compiled on a GPU), "paged" (a C++ decode kernel reading the blocks in
    place, CPU only) or "auto"/None: paged on a CPU where the kernel builds, else torch; see
    ``engines.inference.kv_cache``.
    ``kv_memory_fraction``: on a CUDA device, the KV budget is at most this fraction of the memory free
    when the engine is built (None: ``kv_cache_bytes`` as given, which must then fit). ``onednn_linear``: on a CPU,
    the model's linear layers compute through oneDNN (``engines.inference.cpu_linear``; the model is the
    engine's from then on, inference only). ``cuda_graphs``: decode steps replay CUDA graphs where the device
    allows (``engines.inference.cuda_graphs``); ``capture_graphs_at_start``: capture them all as the engine starts,
    so none is captured while it decodes (None: wherever they are keyed by batch size alone, as with "triton";
    False: each at first use). ``decode_steps``: a step that only decodes runs up to this many forwards back to
    back, each sampling on the device from the one before, and the host reads their tokens once (multi-step
    decoding: the host's planning and recording no longer sit between a GPU's steps; a row that stops early
    wastes the rest, and new requests wait for the read). Tokens are the same as one step at a time.
    ``compiled``: each decoder layer's forward compiled around the paged attention (``engines.model.native.compile``:
    norms, RoPE, projections, SwiGLU fused; on a GPU what the graphs capture), compiled at the first forward of each
    shape kind and cached on disk for later processes.
    """

    kind = "native"
    capabilities = NATIVE
    weight_update = "swap"  # an update is loaded aside, then swapped in at its commit (swap_weights)

    def __init__(self, model: CausalLM, eos_id: int | Sequence[int] | None, pad_id: int | None = None, *,
                 max_seq_len: int | None = None, kv_cache_bytes: int = 512 * 2**20, max_num_seqs: int = 512,
                 max_batch_tokens: int = 8192, block_size: int | None = None, seed: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None, cuda_graphs: bool = True,
                 attention: str | None = None, kv_memory_fraction: float | None = None,
                 onednn_linear: bool = True, capture_graphs_at_start: bool | None = None,
                 record_routes: bool = False, decode_steps: int = 1, compiled: bool = False) -> None:
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
        self.attention = decode_attention(attention, self.device)
        self.compiled = compiled
        if compiled:  # before any graph is captured: the graphs replay the compiled layers' kernels
            compile_layers(model)
        # on a CPU the linear layers through oneDNN (engines.inference.cpu_linear): the model is the engine's now
        # (compiled layers keep torch's: inductor does not trace the routed ones)
        self.onednn_linears = cpu_linear.route_linears(model) if onednn_linear and not compiled and \
            self.device.type == "cpu" else 0
        # flex_attention reads the pool through block masks whose blocks should match its tiles
        self.block_size = block_size or (FLEX_BLOCK_SIZE if self.attention == "flex" else BLOCK_SIZE)
        self.max_blocks = -(-self.max_seq_len // self.block_size)  # block-table width
        use_graphs = cuda_graphs and graphs_supported(self.device, cfg)
        per_block = bytes_per_token(cfg, self.dtype) * self.block_size
        need = per_block * (self.max_blocks + use_graphs)  # one full sequence, and the graphs' scratch block
        if kv_cache_bytes < need:
            raise ValueError(f"a KV cache budget of {kv_cache_bytes} bytes holds no sequence of {self.max_seq_len} "
                             f"tokens ({per_block * self.max_blocks} bytes each); raise kv_cache_bytes or lower "
                             "max_seq_len")
        budget = kv_cache_bytes
        if kv_memory_fraction is not None and self.device.type == "cuda":
            budget = fit_kv_budget(budget, need, free_device_bytes(self.device), kv_memory_fraction, self.device)
        self.num_blocks, self.kv_cache_bytes = paged_pool(cfg, budget, self.dtype, self.block_size)
        # a graph's padding rows write their keys somewhere: into the last block, which no sequence gets
        self.scratch_block = self.num_blocks - 1 if use_graphs else None
        self.max_num_seqs = max_num_seqs
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be at least 1, got {decode_steps}")
        self.decode_steps = decode_steps
        self.max_batch_tokens = max(max_batch_tokens, max_num_seqs + 1)  # room for every decode row and a chunk
        self.detokenize = detokenize
        self._seed = seed
        self._ids = itertools.count()
        self.sched = self._new_scheduler()
        self._weights_loaded = True
        self._merger: AdapterMerger | None = None  # LoRA: the base copies merge_adapters merges from
        self._adapter_base = False  # keep_adapter_base: a LoRA replica, whose base outlives a level-2 sleep
        self._restore = False  # its weights were discarded since the last merge: the next one writes them all
        self._delta: LowRankDelta | None = None
        self.memory = EngineMemory(self.named_tensors(), self.kv_cache_bytes, self.device)
        self.generated = 0  # tokens sampled over the engine's life
        self.steps = 0  # forwards run over the engine's life
        self.reads = 0  # host reads of sampled tokens (one per step, one per multi-step run of forwards)
        self.peak_blocks = 0  # most KV blocks held at once (callers may reset it)
        self.runner = ModelRunner(model, self.memory, self.eos_ids, attention=self.attention,
                                  block_size=self.block_size, max_blocks=self.max_blocks, num_blocks=self.num_blocks,
                                  max_num_seqs=max_num_seqs, scratch_block=self.scratch_block, cuda_graphs=use_graphs,
                                  capture_at_start=capture_graphs_at_start)
        self.record_routes = record_routes
        if record_routes:
            if not cfg.is_moe:
                raise ValueError("record_routes: this model has no mixture-of-experts layers to record")
            self.runner.record_routes(sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers))),
                                      cfg.num_experts_per_tok)
        self.capture_graphs()

    def _new_scheduler(self) -> Scheduler:
        blocks = self.num_blocks - (self.scratch_block is not None)
        return Scheduler(BlockAllocator(blocks, self.block_size), self.max_num_seqs, self.max_batch_tokens)

    @property
    def kv(self) -> PagedKVCache | None:
        """The KV pool (None while asleep, until the next step lays it out again)."""
        return self.runner.kv

    # --- requests -------------------------------------------------------------------------

    @property
    def running(self) -> list[Request]:
        """Requests decoding now, in row order."""
        return self.sched.running

    @property
    def waiting(self) -> list[Request]:
        """Requests not decoding yet: prefills under way (with the samples sharing them), then the queue."""
        return [x for p in self.sched.prefilling for x in (p, *p.followers)] + list(self.sched.waiting)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, prior: Sequence[int] = (),
                    prior_logprobs: Sequence[float] = (), request_id: int | None = None,
                    images: Sequence[Any] = ()) -> int:
        """Queue a request; raises InvalidRequestError (and queues nothing) if it cannot be served.

        ``prior``/``prior_logprobs`` are tokens already generated for it (a resumed request). ``images`` are
        refused: the native engine runs text-only models.
        """
        if images:
            raise InvalidRequestError("the native engine runs text-only models and takes no images; set "
                                      "rollout.engine: vllm for a vision-language model")
        cfg = self.model.config
        prompt = check_request(prompt_ids, params, prior, prior_logprobs, vocab=cfg.vocab_size,
                               context=cfg.max_position_embeddings, max_seq_len=self.max_seq_len,
                               detokenizes=self.detokenize is not None,
                               step_top_logprobs=self.capabilities.step_top_logprobs)
        vocab = cfg.vocab_size
        matcher = new_matcher(params, prior)
        rid = next(self._ids) if request_id is None else request_id
        seed = self.request_seed(params, rid)
        self.sched.waiting.append(Request(id=rid, prompt=prompt, params=params, seed=seed,
                                          tokens=[int(t) for t in prior],
                                          logprobs=[float(x) for x in prior_logprobs], matcher=matcher,
                                          filter_kind=filter_kind(params.top_k, params.top_p, vocab),
                                          top_logprobs=[None] * len(prior) if params.top_logprobs else None))
        return rid

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    def step(self) -> list[Completion]:
        """One forward: a token for every decoding request, the next chunk of prefills; returns the
        requests that finished. With ``decode_steps`` > 1, a step of decoding rows only runs up to that many
        forwards back to back (``_steps_ahead`` says how many)."""
        self._check_awake()
        plan = self.sched.schedule()
        ahead = self._steps_ahead(plan)
        self.peak_blocks = max(self.peak_blocks, self.sched.alloc.used())
        if ahead > 1:
            self.reads += 1
            return self._record_ahead(plan, self.runner.execute_ahead(plan, ahead))
        out = self.runner.execute(plan)
        if out is None:
            return []
        self.steps += 1
        self.reads += 1
        return self._record(plan, out)

    def pause(self) -> list[Completion]:
        """Stop every unfinished request; returns them (finish_reason None) with tokens so far. Their full
        blocks stay cached, so resuming before the weights change recomputes little."""
        routes = {r.id: self._routes(r) for r in self.sched.running + self.sched.prefilling}
        out = [r.completion(None) for r in self.sched.clear()]
        for c in out:
            c.routed_experts = routes.get(c.request_id, self._routes(None)) if self.record_routes else None
        return out

    def progress(self, since: Mapping[int, int]) -> dict[int, Progress]:
        """What each unfinished request among ``since``'s ids generated from the token ``since[id]`` on."""
        return {r.id: r.progress(since[r.id]) for r in (*self.running, *self.waiting) if r.id in since}

    def prompt_logprobs(self, token_ids: Sequence[int], top: int = 0) -> list[TokenLogprob | None]:
        """Each token's log-probability given the ones before it (None for the first) and the ``top`` most likely
        tokens at its position: one forward of the sequence, outside the KV cache and the running batch."""
        self._check_awake()
        cfg = self.model.config
        return self.runner.score(check_prompt(token_ids, vocab=cfg.vocab_size, context=cfg.max_position_embeddings),
                                 top)

    def decode_logits(self, rows: int, width: int | None = None) -> torch.Tensor:
        """Next-token logits [rows, V] of decoding rows 0..rows-1 from their last token, writing its key/value
        into the cache; ``width`` (≥ every position + 1, default the longest row's) fixes the attention span, as
        CUDA graphs need."""
        width = width if width is not None else max(r.context_len for r in self.running[:rows])
        return self.runner.decode_logits(rows, width)

    def capture_graphs(self) -> int:
        """Capture every decode graph the engine captures at start and lacks (laying out the KV pool first);
        returns how many (0 without graphs, or where they are captured at first use)."""
        g = self.runner.graphs
        if g is None or not g.at_start or g.failed is not None:
            return 0
        self._check_awake()
        return g.capture_all()

    def stats(self) -> dict[str, float]:
        """Counters: prompt tokens found in the prefix cache and computed, blocks, preemptions, tokens, steps
        (forwards) and the host reads of their tokens, CUDA graphs captured and whether their capture failed (1:
        decoding eagerly instead)."""
        a, g = self.sched.alloc, self.runner.graphs
        looked = a.hits + a.misses
        return {"prefix_hit_tokens": a.hits, "prefix_miss_tokens": a.misses,
                "prefix_hit_rate": a.hits / looked if looked else 0.0, "kv_blocks": a.num_blocks,
                "kv_blocks_used": a.used(), "kv_blocks_peak": self.peak_blocks, "preemptions": self.sched.preemptions,
                "generated_tokens": self.generated, "steps": self.steps, "host_reads": self.reads,
                "cuda_graph_captures": g.captures if g is not None else 0,
                "cuda_graphs_fallback": int(g is not None and g.failed is not None)}

    # --- colocation -----------------------------------------------------------------------

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors the checkpoint engine writes into, by the model's names (each storage once)."""
        return model_tensors(self.model)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1; on an accelerator the weights also move to host memory)
        or the KV cache and the weights (level 2: weights must be loaded again after ``wake_up``).
        Where the weights and the pool live in arenas their addresses stay, and so do captured graphs."""
        if level not in (levels := self.capabilities.sleep_levels):
            raise ValueError(f"sleep level must be {' or '.join(map(str, levels))}, got {level}")
        if self.has_unfinished():
            raise RuntimeError(f"{len(self.running) + len(self.waiting)} requests unfinished; pause() them "
                               "before sleep()")
        self.runner.drop_cache()
        self.sched = self._new_scheduler()  # a fresh pool: nothing cached survives
        if level == 2 and self._adapter_base and self._weights_loaded:
            # the adapters' updates carry no base: keep all of it (the unadapted weights are still the base)
            served = hub_state(self.model)
            if self._merger is None:
                self._merger = AdapterMerger(served, served, host_buffer)
            else:
                self._merger.keep(served, served)
            self._restore = True
        kept = self.memory.sleep(level, self.named_tensors())
        if self.runner.graphs is not None and not kept:
            self.runner.graphs.clear()  # their memory pool goes too: the addresses they read will move
        if level == 2:
            self._weights_loaded = False

    def wake_up(self, kv_cache: bool = True) -> None:
        """Reallocate what ``sleep`` freed (level-2 weights come back as zeros, or uninitialised where they
        could not live in an arena). The KV pool is mapped again when the next step needs it, so a wake is
        always two-step here and ``kv_cache`` changes nothing."""
        self.memory.wake(self.named_tensors())

    def mapped_bytes(self) -> int:
        """Device bytes mapped in the engine's arenas now: the weights and pool, which a CUDA caching
        allocator's counters do not see (on the host they are in the resident set already)."""
        return self.memory.mapped_bytes()

    @property
    def sleeping(self) -> int:
        """0 when awake, else the level of the last ``sleep``."""
        return self.memory.level

    def weights_loaded(self) -> None:
        """Declare the weights changed and valid (a complete update arrived, in place or not): cached
        prefixes are dropped, since their keys came from the old weights."""
        self._weights_loaded = True
        self.sched.alloc.invalidate()

    def weight_placements(self) -> dict[str, tuple[str, int]]:
        """Checkpoint tensor name -> (the engine's own tensor holding it, byte offset): q/k/v and gate/up
        are fused here, FP8 replicas keep block scales beside their matrices."""
        return byte_placements(self.model)

    def swap_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Serve with ``tensors`` (own names), an update the checkpoint engine loaded aside."""
        for name, t in tensors.items():
            owner, _, attr = name.rpartition(".")
            getattr(self.model.get_submodule(owner), attr).data = t
        self.weights_loaded()

    def served_weights(self) -> dict[str, torch.Tensor]:
        """The weights being served under the checkpoint's names (views of the engine's tensors)."""
        return hub_state(self.model)

    def reset_peaks(self) -> None:
        """Start a new phase for ``stats()["kv_blocks_peak"]``."""
        self.peak_blocks = 0

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the engine's weights by their checkpoint names (e.g. from a safetensors
        file), whatever the engine's own layout."""
        mine = hub_state(self.model)
        for name, t in tensors:
            if name not in mine or mine[name].shape != t.shape:
                raise ValueError(f"no weight {name} of shape {tuple(t.shape)} in the inference engine")
            mine[name].copy_(t)
        self._merger, self._restore = None, False  # a new base: the next merge copies it again
        self.weights_loaded()

    def keep_adapter_base(self) -> None:
        """This replica serves base + LoRA adapters merged on receipt (``merge_adapters``): a level-2 sleep keeps
        a host copy of the base (every weight), which the next merge writes back with the adapters, since the
        adapters' updates carry no base."""
        self._adapter_base = True

    @property
    def adapter_base_bytes(self) -> int:
        """Bytes of the base copies that ``merge_adapters`` holds (0 before the first merge after a load)."""
        return self._merger.base_bytes if self._merger is not None else 0

    def merge_adapters(self, adapters: Mapping[str, torch.Tensor], scaling: float, *, keep_base: bool = True) -> None:
        """Serve the base plus LoRA ``adapters`` (every adapter, by the trainer's names: ``...q_proj.lora_A.weight``
        [r, in], ``...lora_B.weight`` [out, r]) at ``scaling`` = alpha/r: each adapted weight becomes W0 + s·B·A,
        computed from a copy of W0 taken at the first merge after the base was loaded (``load_weights``), so
        repeated updates never accumulate rounding. The base must be what the engine serves at that first merge.
        ``keep_base`` False (one adapter served for good, as ``rl serve --adapter``): the same sum written in place
        once, no copy of the base kept; a later merge would then add onto this one."""
        served = hub_state(self.model)
        if keep_base or self._merger is not None:
            if self._merger is None:
                self._merger = AdapterMerger(served, adapter_pairs(adapters), host_buffer)
            self._merger.apply(served, adapters, scaling, restore=self._restore)
            self._restore = False
        else:
            with torch.no_grad():
                for _ in merge_adapters_into(adapters, scaling, served, served.__getitem__):
                    pass
        self.weights_loaded()

    def load_adapter_deltas(self, adapters: Mapping[str, torch.Tensor], scaling: float) -> None:
        """Serve the base as it is plus LoRA ``adapters`` (as ``merge_adapters`` takes them) unmerged: copied into
        the layers' low-rank deltas (``engines.model.lora.delta``), megabytes in place; after a level-2 sleep the
        base is first written back from its host copy."""
        if self._restore:
            self._merger.restore(hub_state(self.model))
            self._restore = False
        if self._delta is None:
            pairs = adapter_pairs(adapters)
            rank = next(a.shape[0] for a, _ in pairs.values() if a is not None)
            self._delta = LowRankDelta(self.model, placements(self.model), list(pairs), rank)
            if self.runner.graphs is not None:
                self.runner.graphs.clear()  # captured without the deltas' products
        self._delta.load(adapters, scaling)
        self.weights_loaded()

    # --- recording a step -----------------------------------------------------------------

    def _check_awake(self) -> None:
        if self.memory.level:
            raise RuntimeError("inference engine is asleep; call wake_up() first")
        if not self._weights_loaded:
            raise RuntimeError("weights were discarded by sleep(level=2); load weights before generating")

    def _record(self, plan: StepPlan, out: StepOutput) -> list[Completion]:
        """The step's output update: prefills that ended take their rows (with the samples sharing them), every
        sampled request gets its token, and the finished ones are released."""
        for c in plan.chunks:
            self.sched.written(c.request, c.end)
            if c.last:
                self.sched.place(c.request)
        finished = []
        for i, r in enumerate(plan.sampled):
            if i < plan.decode:
                self.sched.written(r, r.context_len)  # the previous token's key/value went in this step
            if self._append(r, out, i):
                finished.append(i)
        self.generated += len(plan.sampled)
        return self._release(finished)

    def _steps_ahead(self, plan: StepPlan) -> int:
        """How many decode steps ``plan`` runs before the host reads them: 1 unless ``decode_steps`` > 1 and the
        plan decodes only, no row follows a grammar (its mask needs each token on the host) and every row may take
        that many more tokens (its budget, which keeps it within ``max_seq_len``); then as many as the rows' blocks
        can be reserved for, without preempting anyone."""
        if self.decode_steps == 1 or plan.chunks or plan.starts or not plan.decode:
            return 1
        room = min(r.params.max_tokens - len(r.tokens) for r in plan.sampled)
        if room < 2 or any(r.matcher is not None for r in plan.sampled):
            return 1
        return self.sched.reserve_ahead(plan, min(self.decode_steps, room))

    def _record_ahead(self, plan: StepPlan, outs: list[StepOutput]) -> list[Completion]:
        """``_record`` of the steps of one ``execute_ahead``, in order: a request that finished in one records
        nothing of the later ones (what its row computed on is dropped)."""
        completions, live = [], list(range(len(plan.sampled)))
        for out in outs:
            finished = []
            for i in live:
                r = plan.sampled[i]
                self.sched.written(r, r.context_len)
                if self._append(r, out, i):
                    finished.append(i)
            self.steps += 1
            self.generated += len(live)
            if finished:
                live = [i for i in live if i not in finished]
                row = {id(r): j for j, r in enumerate(self.sched.running)}  # releases moved rows: look them up
                completions += self._release([row[id(plan.sampled[i])] for i in finished])
        return completions

    def _append(self, r: Request, out: StepOutput, i: int) -> bool:
        """Give ``r`` its token of ``out`` (row ``i``'s); True when it finished with it (EOS, a stop token, its
        budget, its grammar's end or a stop string)."""
        t = out.tokens[i]
        r.tokens.append(t)
        r.logprobs.append(out.logprobs[i])
        if r.top_logprobs is not None:
            r.top_logprobs.append(out.top_logprobs[i])
        return out.done[i] or (r.matcher is not None and _grammar_done(r.matcher, t)) or \
            bool(r.params.stop and self._stop_string(r) is not None)

    def _routes(self, r: Request | None) -> np.ndarray | None:
        """The experts each position of ``r`` the model has read took (its blocks' routes), before they are freed;
        an empty array for a request not computed yet."""
        if not self.record_routes:
            return None
        if r is None or r.seq is None or not r.seq.computed:
            return _no_routes(self.runner)
        return self.runner.read_routes(r.seq.blocks, r.seq.computed).numpy()

    def _stop_string(self, r: Request) -> str | None:
        longest = max(map(len, r.params.stop))
        # a token is at least one byte, so the last `longest` tokens (+1 for a split character) hold any new match
        tail = self.detokenize(r.tokens[-longest - 1:])
        return next((s for s in r.params.stop if s in tail), None)

    def _stop_reason(self, r: Request) -> int | str | None:
        """What stopped a finished request: a stop token id (EOS included), a stop string, or None."""
        tok = r.tokens[-1]
        if tok in r.params.stop_token_ids or (tok in self.eos_ids and not r.params.ignore_eos):
            return tok
        if r.matcher is not None and r.matcher.is_terminated():
            return tok  # the grammar's stop token ended it (even with ignore_eos)
        return self._stop_string(r) if r.params.stop else None

    def _release(self, finished: list[int]) -> list[Completion]:
        out = []
        for row in sorted(set(finished), reverse=True):
            r = self.running[row]
            why = self._stop_reason(r)
            out.append(r.completion("length" if why is None else "stop", why))
            out[-1].routed_experts = self._routes(r) if self.record_routes else None
            self.sched.release(row)  # the row move it makes reaches the runner with the next plan
        return out[::-1]


def _no_routes(runner) -> np.ndarray:
    return np.zeros((0, *runner.routes.shape[1:]), np.int32)


def _grammar_done(matcher, token: int) -> bool:
    """Feed the sampled token to the request's grammar; True when the grammar ended (or rejects it)."""
    return bool(advance_matchers([matcher], torch.tensor([token]))[0])
