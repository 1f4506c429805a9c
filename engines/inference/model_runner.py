"""The native engine's model runner: the device side of a step, executed from the scheduler's plan.

The runner owns the per-row state on the device (each decoding row's last token, position, counters, stop ids,
sampling parameters and block table), the KV pool, and the CUDA graphs of decode steps. ``execute`` takes one
``StepPlan`` (``engines.inference.scheduler``): it moves rows and copies blocks as the plan says, runs one
forward over the decode rows and the prefill chunks, sets up the rows that start decoding, and samples a token
for every row. It returns the tokens, their log-probs and which rows hit a stop the device can see (EOS, a stop
id, the token budget) in one ``StepOutput``: the step's one read of the device. It reads the plan's requests and
never changes them nor calls back: recording the step is the engine's (``engines.inference.native``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.device import host_buffer
from engines.inference.colocation import EngineMemory
from engines.inference.cuda_graphs import DecodeGraphs
from engines.inference.kv_cache import PagedKVCache, PagedPass, Ragged, rows_of
from engines.inference.requests import MAX_STOP_IDS, TokenLogprob, TopLogprobs
from engines.inference.sampling import RowParams, mask_logits, sample
from engines.inference.scheduler import RowStart, StepPlan
from engines.inference.uploads import upload, upload_rows
from engines.model.native import routing
from engines.model.native.attention import padded_causal_mask, positions_from_valid
from engines.model.native.causal_lm import CausalLM

#: Positions whose float log-softmax over the vocabulary is taken at once when a sequence is scored.
SCORE_ROWS = 1024


@dataclass(frozen=True)
class StepOutput:
    """What one step sampled, per row of the plan's ``sampled`` requests: the token, its log-prob, whether
    the row hit EOS, a stop token id or its token budget and, for rows whose request asks ``top_logprobs``, the
    most likely tokens at the position (None for the others; the list is None when no row asks)."""

    tokens: list[int]
    logprobs: list[float]
    done: list[bool]
    top_logprobs: list[TopLogprobs | None] | None = None


class ModelRunner:
    """Forward, sampling, per-row state and CUDA graphs of one engine's model.

    ``attention`` is the resolved decode backend ("torch", "flex", "paged" or "triton"); the pool has ``num_blocks``
    blocks of ``block_size`` tokens (laid in ``memory``'s KV arena where it has one), a block table holds
    ``max_blocks`` of them, and at most ``max_num_seqs`` rows decode at once. ``scratch_block`` (a block no
    sequence gets) is where the padding rows of a captured graph write; with ``cuda_graphs`` decode-only steps
    replay graphs, captured all at once or each at first use as ``capture_at_start`` says (``DecodeGraphs``)."""

    def __init__(self, model: CausalLM, memory: EngineMemory, eos_ids: list[int], *, attention: str,
                 block_size: int, max_blocks: int, num_blocks: int, max_num_seqs: int, scratch_block: int | None,
                 cuda_graphs: bool, capture_at_start: bool | None = None) -> None:
        self.model, self.memory = model, memory
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.attention, self.block_size, self.max_blocks = attention, block_size, max_blocks
        self.num_blocks, self.max_num_seqs, self.scratch_block = num_blocks, max_num_seqs, scratch_block
        self.kv: PagedKVCache | None = None
        self.routes: torch.Tensor | None = None  # [pool slots, MoE layers, k]: see record_routes
        self.graphs = DecodeGraphs(self, capture_at_start) if cuda_graphs else None
        # allocated once and kept through sleep: graphs read these addresses, and the host table stays pinned
        s, dev = max_num_seqs, self.device
        z = dict(dtype=torch.long, device=dev)
        self.pos, self.last, self.gen, self.max_gen = (torch.zeros(s, **z) for _ in range(4))
        self.stop_ids = torch.full((s, MAX_STOP_IDS), -1, **z)
        self.eos_stop = torch.zeros(s, dtype=torch.bool, device=dev)
        self._eos = torch.tensor(eos_ids, **z)
        self.rows = RowParams(torch.zeros(s, device=dev), torch.zeros(s, **z), torch.ones(s, device=dev),
                              torch.zeros(s, **z))
        self.block_table = torch.zeros(s, max_blocks, **z)
        # pinned on a GPU, so that its copies to the device need not wait
        self._tables_host = host_buffer(s * max_blocks * 8, pinned=dev.type == "cuda").view(torch.long).view(
            s, max_blocks)
        self._tables_host.zero_()

    # --- the step -------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepOutput | None:
        """Run ``plan``: its moves and copies, then (if it computes anything) the forward and the sampling."""
        self._prepare(plan)
        if not plan.computes:
            return None
        n = plan.decode
        logits = self._forward(plan)
        if plan.starts:  # prefills that reached their last token: their rows sample from their last chunk's logits
            self._set_rows(plan.starts)
            logits = logits[upload([*range(n), *(n + s.chunk for s in plan.starts)], self.device)]
        return self._sample(plan, logits[: len(plan.sampled)])

    def execute_ahead(self, plan: StepPlan, steps: int) -> list[StepOutput]:
        """Run decode-only ``plan`` and ``steps`` - 1 more decode steps of the same rows back to back, each fed
        the tokens the one before sampled on the device, with one read of the device for all of them (multi-step
        decoding: the host plans and records once per ``steps``). The scheduler reserved every row's blocks for
        them; a row that stops early computes on into its own blocks, and what it samples then is not recorded."""
        assert plan.decode and not plan.chunks and not plan.starts
        self._prepare(plan)
        drawn = [self._draw(plan, self._forward(plan, width=plan.width + i)) for i in range(steps)]
        host = torch.stack([flat for flat, _ in drawn]).tolist()  # the one host transfer of the steps
        return [self._unpack(h, plan, shape) for h, (_, shape) in zip(host, drawn, strict=True)]

    def decode_logits(self, rows: int, width: int) -> torch.Tensor:
        """Next-token logits [rows, V] of rows 0..rows-1 from their last token, writing its key/value into the
        cache; ``width`` (≥ every position + 1) is the attention span (fixed per graph when captured)."""
        pos = self.pos[:rows]
        table = self.block_table[:rows]
        write = rows_of(table, pos[:, None], self.block_size)[:, 0]
        step = PagedPass(self.cache(), write, [Ragged.decode(table, pos, width)], self.attention)
        return self._model(write, self.last[None, :rows], pos[None], cache=step)[0]

    def record_routes(self, layers: int, top_k: int) -> None:
        """From now on keep each computed token's experts (``layers`` MoE layers, top-``top_k``) at its cache slot,
        as its key and value are kept: requests sharing a cached prefix share its routes too."""
        self.routes = torch.zeros(self.num_blocks * self.block_size, layers, top_k, dtype=torch.int32,
                                  device=self.device)

    def read_routes(self, blocks: list[int], n: int) -> torch.Tensor:
        """The routes [n, layers, k] (on the host) of positions 0..n-1 of a sequence laid in ``blocks``."""
        assert self.routes is not None
        bs = self.block_size
        slots = [blocks[p // bs] * bs + p % bs for p in range(n)]
        return self.routes[upload(slots, self.device)].cpu()

    def _model(self, write: torch.Tensor, *args, **kw) -> torch.Tensor:
        """The model's forward; with routes recorded, each computed token's experts go to its cache slot."""
        if self.routes is None:
            return self.model(*args, **kw)
        with routing.recording() as tape:
            out = self.model(*args, **kw)
        self.routes[write] = routing.stacked(tape).to(self.routes.dtype)
        return out

    def score(self, token_ids: list[int], top: int) -> list[TokenLogprob | None]:
        """Each token's log-probability given those before it (None for the first) and the ``top`` likeliest
        tokens at its position, from one forward of the whole sequence outside the KV cache."""
        ids = upload([token_ids], self.device)
        valid = torch.ones_like(ids, dtype=torch.bool)
        with torch.no_grad():
            logits = self.model(ids, positions_from_valid(valid), padded_causal_mask(valid))[0, :-1]
        out: list[TokenLogprob | None] = [None]
        targets = ids[0, 1:, None]
        for a in range(0, len(token_ids) - 1, SCORE_ROWS):  # the float log-softmax a slice of positions at a time
            lp = torch.log_softmax(logits[a: a + SCORE_ROWS].float(), dim=-1)
            chosen = lp.gather(1, targets[a: a + SCORE_ROWS])[:, 0].tolist()
            if top:
                values, indices = lp.topk(min(top, lp.shape[-1]), dim=-1)
                tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
            else:
                tops = [[] for _ in chosen]
            out += [TokenLogprob(c, t) for c, t in zip(chosen, tops, strict=True)]
        return out

    def cache(self) -> PagedKVCache:
        """The KV pool, laid out again after a sleep dropped it."""
        if self.kv is None:
            self.kv = PagedKVCache(self.model.config, self.num_blocks, self.block_size, self.dtype, self.device,
                                   self.memory.kv_storage())
        return self.kv

    def drop_cache(self) -> None:
        """Forget the pool's tensors (the engine is going to sleep and gives the memory back)."""
        self.kv = None

    # --- internals ------------------------------------------------------------------------

    def _prepare(self, plan: StepPlan) -> None:
        """The plan's row moves and block copies, in order, and the decoding rows' new block tables."""
        cache = self.cache()
        for src, dst in plan.moves:
            self._move(src, dst)
        cache.copy_blocks(plan.copies)
        if self.routes is not None:  # a block copied before it is written keeps the routes of what it holds
            bs = self.block_size
            for src, dst in plan.copies:
                self.routes[dst * bs:(dst + 1) * bs] = self.routes[src * bs:(src + 1) * bs]
        self._sync_tables(plan.decode, plan.tables)

    def _sync_tables(self, n: int, tables: dict[int, list[int]]) -> None:
        """Bring the device block table of rows 0..n-1 up to date with the plan's new tables."""
        for row, blocks in tables.items():
            self._tables_host[row, : len(blocks)] = torch.tensor(blocks)
        if n:
            self.block_table[:n].copy_(self._tables_host[:n], non_blocking=True)

    def _forward(self, plan: StepPlan, width: int | None = None) -> torch.Tensor:
        """Logits of the decode rows, then of the last token of each prefill chunk (decode rows only: over
        ``width`` positions, the plan's by default)."""
        n = plan.decode
        if not plan.chunks:
            width = plan.width if width is None else width
            if self.graphs is not None and self.graphs.failed is None:
                return self.graphs.logits(n, width)
            return self.decode_logits(n, width)
        bs, dev = self.block_size, self.device
        ids, positions, write, last, q_index, q_pos, tables = [], [], [], [], [], [], []
        offset = n
        for c in plan.chunks:
            start, end = c.start, c.end
            ctx, blocks = c.request.context, c.request.seq.blocks
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
        groups = [Ragged(qi, qp, tab, max(c.end for c in plan.chunks))]
        if n:
            table, pos = self.block_table[:n], self.pos[:n]
            groups.insert(0, Ragged.decode(table, pos, plan.width))
            flat_ids = torch.cat((self.last[:n], flat_ids))
            flat_pos = torch.cat((pos, flat_pos))
            flat_write = torch.cat((rows_of(table, pos[:, None], bs)[:, 0], flat_write))
        select = torch.cat((torch.arange(n, device=dev), sel))
        step = PagedPass(self.cache(), flat_write, groups, self.attention)
        return self._model(flat_write, flat_ids[None], flat_pos[None], cache=step, select=select)

    def _set_rows(self, starts: list[RowStart]) -> None:
        """Per-row state of requests that start decoding: one upload for all of them, not a device write per
        field and row."""
        ints, floats, rows = [], [], []
        for s in starts:
            r, row = s.request, s.row
            p = r.params
            table = s.blocks + [0] * (self.max_blocks - len(s.blocks))  # unused entries: any valid block
            self._tables_host[row] = torch.tensor(table)
            stops = list(p.stop_token_ids) + [-1] * (MAX_STOP_IDS - len(p.stop_token_ids))
            ints.append([r.context_len, len(r.tokens), p.max_tokens, int(not p.ignore_eos), p.top_k, r.seed,
                         *stops, *table])
            floats.append([p.temperature, p.top_p])
            rows.append(row)
        idx, v = upload_rows([rows], [ints], self.device)
        f = upload(floats, self.device, torch.float32)
        for j, t in enumerate((self.pos, self.gen, self.max_gen, self.eos_stop, self.rows.top_k, self.rows.seed)):
            t.index_copy_(0, idx, v[:, j].to(t.dtype))
        self.stop_ids.index_copy_(0, idx, v[:, 6: 6 + MAX_STOP_IDS])
        self.block_table.index_copy_(0, idx, v[:, 6 + MAX_STOP_IDS:])
        self.rows.temperature.index_copy_(0, idx, f[:, 0])
        self.rows.top_p.index_copy_(0, idx, f[:, 1])

    def _sample(self, plan: StepPlan, logits: torch.Tensor) -> StepOutput:
        """The next token of every sampled row from ``logits`` (``_draw``), read back in the step's one host
        transfer."""
        flat, shape = self._draw(plan, logits)
        return self._unpack(flat.tolist(), plan, shape)

    def _draw(self, plan: StepPlan, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Size | None]:
        """The next token of every sampled row from ``logits``, on the device: tokens, log-probs, finished flags
        (and the alternatives asked for, whose [m, k] shape comes second) as one float64 tensor. The decode rows
        wrote their last token's key/value this step, so their positions advance. Where a graph replayed the step
        and no row filters its draw, the graph's own draw is taken: the tokens and log-probs ``sample`` gives,
        already computed."""
        reqs = plan.sampled
        sl = slice(0, len(reqs))
        # asked first, every step: the replay's draw is handed over once and must not outlive its step
        drawn = self.graphs.sampled(len(reqs)) if self.graphs is not None else None
        gen = self.gen[sl].clone()  # a copy: the counters advance below
        want = [r.params.top_logprobs for r in reqs]
        # from the logits before any grammar mask, at temperature 1: the model's own alternatives
        tops = _top_logprobs(logits, want) if any(want) else None
        if drawn is not None and all(r.filter_kind == 0 and r.matcher is None for r in reqs):
            tok, lp = drawn  # alternatives asked for come from the logits all the same
        else:
            if any(r.matcher is not None for r in reqs):
                # logprobs are then those of the masked distribution, the one the tokens are drawn from
                logits = mask_logits(logits, [r.matcher for r in reqs])
            tok, lp = sample(logits, self.rows[sl], gen, [r.filter_kind for r in reqs])
        self.last[sl] = tok
        self.gen[sl] = gen + 1
        self.pos[: plan.decode] += 1
        done = (torch.isin(tok, self._eos) & self.eos_stop[sl]) | (self.stop_ids[sl] == tok[:, None]).any(1)
        done |= gen + 1 >= self.max_gen[sl]
        # read in one host transfer: tokens, logprobs, finished flags and the alternatives together
        flat = torch.stack((tok.double(), lp.double(), done.double())).flatten()
        if tops is None:
            return flat, None
        return torch.cat((flat, tops[0].double().flatten(), tops[1].double().flatten())), tops[0].shape

    def _unpack(self, host: list[float], plan: StepPlan, shape: torch.Size | None) -> StepOutput:
        """The ``StepOutput`` of one step's ``_draw``, read back."""
        n = len(plan.sampled)
        toks, lps, dones = host[:n], host[n: 2 * n], host[2 * n: 3 * n]
        want = [r.params.top_logprobs for r in plan.sampled]
        out_tops = None if shape is None else _unpack_tops(host[3 * n:], want, shape)
        return StepOutput([int(t) for t in toks], lps, [bool(d) for d in dones], out_tops)

    def _move(self, src: int, dst: int) -> None:
        """Copy row ``src``'s per-row state to row ``dst`` (the scheduler already moved the request)."""
        for t in (self.pos, self.last, self.gen, self.max_gen, self.stop_ids, self.eos_stop, self.block_table,
                  self.rows.temperature, self.rows.top_k, self.rows.top_p, self.rows.seed):
            t[dst] = t[src]
        self._tables_host[dst] = self._tables_host[src]


def _top_logprobs(logits: torch.Tensor, want: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``max(want)`` most likely tokens (log-probs [m, k], ids [m, k]) of the m rows that want any, under
    log softmax(logits) in float32, as a scoring forward computes them."""
    rows = [i for i, w in enumerate(want) if w]
    lp = torch.log_softmax((logits if len(rows) == len(want) else logits[upload(rows, logits.device)]).float(), dim=-1)
    return lp.topk(min(max(want), lp.shape[-1]), dim=-1)


def _unpack_tops(host: list[float], want: list[int], shape: torch.Size) -> list[TopLogprobs | None]:
    """Each row's alternatives from the host copy of ``_top_logprobs``' values then ids (None: a row not asking)."""
    m, k = shape
    values, ids = host[: m * k], host[m * k:]
    out: list[TopLogprobs | None] = []
    j = 0
    for w in want:
        if not w:
            out.append(None)
            continue
        row = slice(j * k, j * k + min(w, k))
        out.append([(int(t), v) for t, v in zip(ids[row], values[row], strict=True)])
        j += 1
    return out


def _pad(rows: list[list[int]]) -> list[list[int]]:
    """Rows of unequal length made equal by repeating each one's last entry."""
    width = max(map(len, rows))
    return [x + [x[-1]] * (width - len(x)) for x in rows]
