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
(``engines.inference.arena``) whose addresses survive the sleep, so captured CUDA graphs are kept. An update of
the weights must be declared (``weights_loaded``) so cached prefixes computed with the old weights are
dropped.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from engines.device import host_buffer
from engines.inference import cpu_kernel, cpu_linear
from engines.inference.arena import CudaError, adopt, new_arena
from engines.inference.base import RolloutEngine
from engines.inference.blocks import BlockAllocator
from engines.inference.cuda_graphs import DecodeGraphs, graphs_supported
from engines.inference.kv_cache import (
    BACKENDS,
    BLOCK_SIZE,
    PagedKVCache,
    PagedPass,
    Ragged,
    bytes_per_token,
    paged_pool,
    rows_of,
)
from engines.inference.requests import MAX_STOP_IDS, Completion, Request, check_request
from engines.inference.sampling import (
    InvalidRequestError,
    RowParams,
    SamplingParams,
    advance_matchers,
    filter_kind,
    mask_logits,
    new_matcher,
    sample,
    token_logprobs,
)
from engines.inference.scheduler import Scheduler, StepPlan
from engines.inference.uploads import upload, upload_rows
from engines.model.causal_lm import CausalLM
from engines.model.layout import byte_placements, hub_state, model_tensors

__all__ = ["Completion", "InferenceEngine", "InvalidRequestError", "SamplingParams", "fit_kv_budget",
           "resolve_attention", "token_logprobs"]

log = logging.getLogger(__name__)

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
    engine's from then on, inference only).
    """

    kind = "native"

    def __init__(self, model: CausalLM, eos_id: int | Sequence[int] | None, pad_id: int | None = None, *,
                 max_seq_len: int | None = None, kv_cache_bytes: int = 512 * 2**20, max_num_seqs: int = 512,
                 max_batch_tokens: int = 8192, block_size: int | None = None, seed: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None, cuda_graphs: bool = True,
                 attention: str | None = None, kv_memory_fraction: float | None = None,
                 onednn_linear: bool = True) -> None:
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
        self.attention = resolve_attention(attention, self.device)
        # on a CPU the linear layers through oneDNN (engines.inference.cpu_linear): the model is the engine's now
        self.onednn_linears = cpu_linear.route_linears(model) if onednn_linear and self.device.type == "cpu" else 0
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
            budget = fit_kv_budget(budget, need, _free_device_bytes(self.device), kv_memory_fraction, self.device)
        self.num_blocks, self.kv_cache_bytes = paged_pool(cfg, budget, self.dtype, self.block_size)
        # a graph's padding rows write their keys somewhere: into the last block, which no sequence gets
        self.scratch_block = self.num_blocks - 1 if use_graphs else None
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max(max_batch_tokens, max_num_seqs + 1)  # room for every decode row and a chunk
        self.detokenize = detokenize
        self._seed = seed
        self._ids = itertools.count()
        self.kv: PagedKVCache | None = None
        self.sched = self._new_scheduler()
        self._sleep_level = 0
        self._weights_loaded = True
        # weights and KV pool at addresses that survive sleep (None where no arena can be had: freed instead)
        self._weight_arena = adopt(self.named_tensors(), self.device)
        self._kv_arena = new_arena(self.kv_cache_bytes, self.device, mapped=False)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the weights' first copies, now in the arena
        self._host_arena: torch.Tensor | None = None  # the weight arena's host copy, pinned once
        self._host_weights: dict[str, torch.Tensor] = {}  # pinned once, reused by every sleep
        self._offloaded: dict[str, tuple[torch.Size, int]] = {}  # emptied by sleep: shape, level
        self.generated = 0  # tokens sampled over the engine's life
        self.steps = 0  # forwards run over the engine's life
        self.peak_blocks = 0  # most KV blocks held at once (callers may reset it)
        self.graphs = DecodeGraphs(self) if use_graphs else None
        self._alloc_state()

    def _new_scheduler(self) -> Scheduler:
        blocks = self.num_blocks - (self.scratch_block is not None)
        return Scheduler(BlockAllocator(blocks, self.block_size), self.max_num_seqs, self.max_batch_tokens)

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
                    prior_logprobs: Sequence[float] = (), request_id: int | None = None) -> int:
        """Queue a request; raises InvalidRequestError (and queues nothing) if it cannot be served.

        ``prior``/``prior_logprobs`` are tokens already generated for it (a resumed request).
        """
        cfg = self.model.config
        prompt = check_request(prompt_ids, params, prior, prior_logprobs, vocab=cfg.vocab_size,
                               context=cfg.max_position_embeddings, max_seq_len=self.max_seq_len,
                               detokenizes=self.detokenize is not None)
        vocab = cfg.vocab_size
        matcher = new_matcher(params, prior)
        rid = next(self._ids) if request_id is None else request_id
        seed = self.request_seed(params, rid)
        self.sched.waiting.append(Request(rid, prompt, params, seed, [int(t) for t in prior],
                                          [float(x) for x in prior_logprobs], matcher,
                                          filter_kind=filter_kind(params.top_k, params.top_p, vocab)))
        return rid

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    def step(self) -> list[Completion]:
        """One forward: a token for every decoding request, the next chunk of prefills; returns the
        requests that finished."""
        self._check_awake()
        cache = self._cache()
        plan = self.sched.schedule()
        self.peak_blocks = max(self.peak_blocks, self.sched.alloc.used())
        for src, dst in plan.moves:
            self._move(src, dst)
        cache.copy_blocks(plan.copies)
        n = plan.decode
        if n == 0 and not plan.chunks:
            return []
        self._sync_tables(n, plan.dirty)
        logits = self._forward(n, plan)
        self.steps += 1
        # prefills that reached their last token start decoding: rows for them and the samples sharing them
        src, placed = list(range(n)), []
        for j, (r, _, end) in enumerate(plan.chunks):
            self._written(r, end)
            if end == r.context_len:
                for row in self.sched.place(r):
                    placed.append(row)
                    src.append(n + j)
        if placed:
            self._set_rows(placed)
            logits = logits[upload(src, self.device)]
        return self._release(self._commit(len(src), logits[: len(src)], n))

    def pause(self) -> list[Completion]:
        """Stop every unfinished request; returns them (finish_reason None) with tokens so far. Their full
        blocks stay cached, so resuming before the weights change recomputes little."""
        return [r.completion(None) for r in self.sched.clear()]

    def stats(self) -> dict[str, float]:
        """Counters: prompt tokens found in the prefix cache and computed, blocks, preemptions, tokens, steps,
        CUDA graphs captured and whether their capture failed (1: decoding eagerly instead)."""
        a, g = self.sched.alloc, self.graphs
        looked = a.hits + a.misses
        return {"prefix_hit_tokens": a.hits, "prefix_miss_tokens": a.misses,
                "prefix_hit_rate": a.hits / looked if looked else 0.0, "kv_blocks": a.num_blocks,
                "kv_blocks_used": a.used(), "kv_blocks_peak": self.peak_blocks, "preemptions": self.sched.preemptions,
                "generated_tokens": self.generated, "steps": self.steps,
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
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.has_unfinished():
            raise RuntimeError(f"{len(self.running) + len(self.waiting)} requests unfinished; pause() them "
                               "before sleep()")
        self.kv = None
        self.sched = self._new_scheduler()  # a fresh pool: nothing cached survives
        if self._kv_arena is not None:
            self._kv_arena.unmap()
        tensors = {k: t for k, t in self.named_tensors().items() if t.numel()}
        w = self._weight_arena
        # an update that swapped in other tensors (rollback "swap") leaves the arena to the receiver's spare
        in_arena = w is not None and all(w.holds(t) for t in tensors.values())
        if self.graphs is not None and not (in_arena and self._kv_arena is not None):
            self.graphs.clear()  # their memory pool goes too: the addresses they read will move
        if in_arena:
            tensors = {}
            if level == 1 and self.device.type != "cpu":
                if self._host_arena is None:
                    self._host_arena = host_buffer(w.nbytes)
                self._host_arena.copy_(w.bytes)
            if level == 2 or self.device.type != "cpu":
                w.unmap()
        for name, t in tensors.items():
            if level == 1 and t.device.type == "cpu":
                continue  # already where it would go
            if level == 1:
                host = self._host_weights.get(name)
                if host is None or host.shape != t.shape or host.dtype != t.dtype:
                    host = self._host_weights[name] = host_buffer(t.nbytes).view(t.dtype).view(t.shape)
                host.copy_(t.data)
            self._offloaded[name] = (t.shape, level)
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self._sleep_level = level
        if level == 2:
            self._weights_loaded = False

    def wake_up(self) -> None:
        """Reallocate what ``sleep`` freed (level-2 weights come back as zeros, or uninitialised where they
        could not live in an arena)."""
        w = self._weight_arena
        if w is not None and not w.mapped:  # only sleep unmaps it
            w.map()
            if self._sleep_level == 1:
                w.bytes.copy_(self._host_arena, non_blocking=True)
        for name, t in self.named_tensors().items():
            if name in self._offloaded:
                shape, level = self._offloaded.pop(name)
                t.data = self._host_weights[name].to(self.device, non_blocking=True) if level == 1 else \
                    torch.empty(shape, dtype=t.dtype, device=self.device)
        self._sleep_level = 0

    def mapped_bytes(self) -> int:
        """Device bytes mapped in the engine's arenas now: the weights and pool, which a CUDA caching
        allocator's counters do not see (on the host they are in the resident set already)."""
        if self.device.type == "cpu":
            return 0
        return sum(a.nbytes for a in (self._weight_arena, self._kv_arena) if a is not None and a.mapped)

    @property
    def sleeping(self) -> int:
        """0 when awake, else the level of the last ``sleep``."""
        return self._sleep_level

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
        self.weights_loaded()

    # --- internals ------------------------------------------------------------------------

    def _check_awake(self) -> None:
        if self._sleep_level:
            raise RuntimeError("inference engine is asleep; call wake_up() first")
        if not self._weights_loaded:
            raise RuntimeError("weights were discarded by sleep(level=2); load weights before generating")

    def _alloc_state(self) -> None:
        # allocated once and kept through sleep: graphs read these addresses, and the host table stays pinned
        s, dev = self.max_num_seqs, self.device
        z = dict(dtype=torch.long, device=dev)
        self.pos, self.last, self.gen, self.max_gen = (torch.zeros(s, **z) for _ in range(4))
        self.stop_ids = torch.full((s, MAX_STOP_IDS), -1, **z)
        self.eos_stop = torch.zeros(s, dtype=torch.bool, device=dev)
        self._eos = torch.tensor(self.eos_ids, **z)
        self.rows = RowParams(torch.zeros(s, device=dev), torch.zeros(s, **z), torch.ones(s, device=dev),
                              torch.zeros(s, **z))
        self.block_table = torch.zeros(s, self.max_blocks, **z)
        # pinned on a GPU, so that its copies to the device need not wait
        self._tables_host = host_buffer(s * self.max_blocks * 8, pinned=dev.type == "cuda").view(torch.long).view(
            s, self.max_blocks)
        self._tables_host.zero_()

    def _cache(self) -> PagedKVCache:
        if self.kv is None:
            storage = None
            if self._kv_arena is not None:
                try:
                    self._kv_arena.map()
                except CudaError as e:
                    free = _free_device_bytes(self.device)
                    raise torch.OutOfMemoryError(
                        f"the KV cache ({self.kv_cache_bytes / 2**20:.0f} MiB) does not fit on {self.device}: "
                        f"{free / 2**20:.0f} MiB free; lower kv_cache_bytes (rollout.kv_cache_mb) or pass "
                        f"kv_memory_fraction ({e})") from e
                storage = self._kv_arena.bytes
            self.kv = PagedKVCache(self.model.config, self.num_blocks, self.block_size, self.dtype, self.device,
                                   storage)
        return self.kv

    def _sync_tables(self, n: int, dirty: set[int]) -> None:
        """Bring the device block table of rows 0..n-1 up to date with the host's."""
        for row in sorted(d for d in dirty if d < n):
            blocks = self.running[row].seq.blocks
            self._tables_host[row, : len(blocks)] = torch.tensor(blocks)
        if n:
            self.block_table[:n].copy_(self._tables_host[:n], non_blocking=True)

    def decode_logits(self, rows: int, width: int | None = None) -> torch.Tensor:
        """Next-token logits [rows, V] of rows 0..rows-1 from their last token, writing its key/value
        into the cache; ``width`` (≥ every position + 1) fixes the attention span, as CUDA graphs need."""
        pos = self.pos[:rows]
        width = width if width is not None else self._width(rows)
        table = self.block_table[:rows]
        write = rows_of(table, pos[:, None], self.block_size)[:, 0]
        step = PagedPass(self._cache(), write, [Ragged.decode(table, pos, width)], self.attention)
        return self.model(self.last[None, :rows], pos[None], cache=step)[0]

    def _width(self, rows: int) -> int:
        return max(r.context_len for r in self.running[:rows])

    def _written(self, r: Request, computed: int) -> None:
        """Positions up to ``computed`` of ``r`` now have their keys/values; full blocks get registered."""
        seq = r.seq
        seq.computed = computed
        if computed // self.block_size > len(seq.hashes):
            self.sched.alloc.commit(seq, r.context, computed)

    def _forward(self, n: int, plan: StepPlan) -> torch.Tensor:
        """Logits of the decode rows, then of the last token of each prefill chunk."""
        if not plan.chunks:
            if self.graphs is not None and self.graphs.failed is None:
                return self.graphs.logits(n, self._width(n))
            return self.decode_logits(n)
        bs, dev = self.block_size, self.device
        ids, positions, write, last, q_index, q_pos, tables = [], [], [], [], [], [], []
        offset = n
        for r, start, end in plan.chunks:
            ctx, blocks = r.context, r.seq.blocks
            ids += ctx[start:end]
            positions += range(start, end)
            write += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            q_index.append(list(range(offset, offset + end - start)))
            q_pos.append(list(range(start, end)))
            tables.append(blocks)
            offset += end - start
            last.append(offset - 1)
        # padding repeats a chunk's last query (see Ragged); everything goes to the device in one copy
        flat_ids, flat_pos, flat_write, sel, qi, qp, tab = upload_rows(
            [ids, positions, write, last], [_pad(q_index), _pad(q_pos), _pad(tables)], dev)
        groups = [Ragged(qi, qp, tab, max(end for _, _, end in plan.chunks))]
        if n:
            table, pos = self.block_table[:n], self.pos[:n]
            groups.insert(0, Ragged.decode(table, pos, self._width(n)))
            flat_ids = torch.cat((self.last[:n], flat_ids))
            flat_pos = torch.cat((pos, flat_pos))
            flat_write = torch.cat((rows_of(table, pos[:, None], bs)[:, 0], flat_write))
        select = torch.cat((torch.arange(n, device=dev), sel))
        step = PagedPass(self._cache(), flat_write, groups, self.attention)
        return self.model(flat_ids[None], flat_pos[None], cache=step, select=select)

    def _set_rows(self, rows: list[int]) -> None:
        """Per-row state of requests that start decoding in ``rows``: one upload for all of them, not a
        device write per field and row."""
        ints, floats = [], []
        for row in rows:
            r = self.running[row]
            p, blocks = r.params, r.seq.blocks
            table = blocks + [0] * (self.max_blocks - len(blocks))  # unused entries: any valid block
            self._tables_host[row] = torch.tensor(table)
            stops = list(p.stop_token_ids) + [-1] * (MAX_STOP_IDS - len(p.stop_token_ids))
            ints.append([len(r.context), len(r.tokens), p.max_tokens, int(not p.ignore_eos), p.top_k, r.seed,
                         *stops, *table])
            floats.append([p.temperature, p.top_p])
        idx, v = upload_rows([rows], [ints], self.device)
        f = upload(floats, self.device, torch.float32)
        for j, t in enumerate((self.pos, self.gen, self.max_gen, self.eos_stop, self.rows.top_k, self.rows.seed)):
            t.index_copy_(0, idx, v[:, j].to(t.dtype))
        self.stop_ids.index_copy_(0, idx, v[:, 6: 6 + MAX_STOP_IDS])
        self.block_table.index_copy_(0, idx, v[:, 6 + MAX_STOP_IDS:])
        self.rows.temperature.index_copy_(0, idx, f[:, 0])
        self.rows.top_p.index_copy_(0, idx, f[:, 1])

    def _commit(self, rows: int, logits: torch.Tensor, decoded: int) -> list[int]:
        """Sample the next token of rows 0..rows-1 from ``logits``; rows below ``decoded`` wrote their last
        token's key/value this step. Returns the rows that finished."""
        sl, reqs = slice(0, rows), self.running[:rows]
        gen = self.gen[sl].clone()  # a copy: the counters advance below
        if any(r.matcher is not None for r in reqs):
            # logprobs are then those of the masked distribution, the one the tokens are drawn from
            logits = mask_logits(logits, [r.matcher for r in reqs])
        tok, lp = sample(logits, self.rows[sl], gen, [r.filter_kind for r in reqs])
        self.last[sl] = tok
        self.gen[sl] = gen + 1
        self.pos[:decoded] += 1
        done = (torch.isin(tok, self._eos) & self.eos_stop[sl]) | (self.stop_ids[sl] == tok[:, None]).any(1)
        done |= gen + 1 >= self.max_gen[sl]
        # the one host transfer of the step: tokens, logprobs and finished flags together
        toks, lps, dones = torch.stack((tok.double(), lp.double(), done.double())).tolist()
        self.generated += rows
        finished = []
        for i, (r, t, lp_i, d) in enumerate(zip(reqs, map(int, toks), lps, dones, strict=True)):
            if i < decoded:
                self._written(r, r.context_len)  # the previous token's key/value went in this step
            r.tokens.append(t)
            r.logprobs.append(lp_i)
            if d or (r.matcher is not None and _grammar_done(r.matcher, t)) or \
                    (r.params.stop and self._stop_string(r) is not None):
                finished.append(i)
        return finished

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
            move = self.sched.release(row)
            if move is not None:
                self._move(*move)
        return out[::-1]

    def _move(self, src: int, dst: int) -> None:
        """Copy row ``src``'s per-row state to row ``dst`` (the scheduler already moved the request)."""
        for t in (self.pos, self.last, self.gen, self.max_gen, self.stop_ids, self.eos_stop, self.block_table,
                  self.rows.temperature, self.rows.top_k, self.rows.top_p, self.rows.seed):
            t[dst] = t[src]
        self._tables_host[dst] = self._tables_host[src]


def resolve_attention(attention: str | None, device: torch.device) -> str:
    """The attention backend an engine on ``device`` runs for ``attention`` ("auto"/None picks): "paged" needs a
    CPU and its kernel; where the kernel cannot be built it falls back to "torch" (one warning, at the build)."""
    if attention not in (None, "auto", *BACKENDS):
        raise ValueError(f"attention must be auto, {', '.join(BACKENDS)}; got {attention!r}")
    if attention == "paged" and device.type != "cpu":
        raise ValueError(f"attention 'paged' is the CPU decode kernel; on {device} use torch or flex")
    if attention in (None, "auto", "paged"):
        return "paged" if device.type == "cpu" and cpu_kernel.available() else "torch"
    return attention


def fit_kv_budget(requested: int, need: int, free: int, fraction: float, device: torch.device | str) -> int:
    """The KV budget on a device with ``free`` bytes free: ``requested``, capped at ``fraction`` of them (the
    rest is for activations and graphs, as vLLM's gpu_memory_utilization keeps); ``need`` is the least that
    serves one sequence, and a cap below it is an error."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {fraction}")
    cap = int(free * fraction)
    if cap < need:
        raise ValueError(f"the KV cache needs at least {need / 2**20:.0f} MiB (one full-length sequence) but "
                         f"{fraction:g} of the {free / 2**20:.0f} MiB free on {device} is {cap / 2**20:.0f} MiB; "
                         "free device memory or lower max_seq_len")
    if requested > cap:
        log.info("KV cache budget %d MiB capped at %d MiB (%g of the memory free on %s)", requested >> 20,
                 cap >> 20, fraction, device)
    return min(requested, cap)


def _free_device_bytes(device: torch.device) -> int:
    """Bytes free on a CUDA device, counting the caching allocator's unused blocks (``empty_cache`` frees them)."""
    free = torch.cuda.mem_get_info(device)[0]
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _pad(rows: list[list[int]]) -> list[list[int]]:
    """Rows of unequal length made equal by repeating each one's last entry."""
    width = max(map(len, rows))
    return [x + [x[-1]] * (width - len(x)) for x in rows]


def _grammar_done(matcher, token: int) -> bool:
    """Feed the sampled token to the request's grammar; True when the grammar ended (or rejects it)."""
    return bool(advance_matchers([matcher], torch.tensor([token]))[0])
