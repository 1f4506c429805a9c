"""Expert-parallel routing: each rank holds whole experts, and tokens travel to them instead of weights to tokens.

With ``ep`` ranks in an expert-parallel group, rank r holds experts [r·E/ep, (r+1)·E/ep) of every MoE layer (the
stacked parameters are ``Shard(0)`` DTensors on the group's mesh, ``engines.training.expert_parallel``). A layer's
forward then runs in four steps over the group:

1. **dispatch**: every (token, choice) pair is sorted by expert, so by owner, and one all-to-all sends each owner
   the hidden states routed to its experts (counts first, so each rank knows what it receives);
2. each owner runs each of its experts once on all the rows it received, in (expert, source rank) order;
3. **combine**: the reverse all-to-all brings every row's expert output back to the rank the token lives on;
4. the token's rank weighs each output by its router weight and sums them, experts in ascending order, as the
   unsharded ``Experts.forward`` does.

The router weights never leave the token's rank, so the router's gradient stays local; the experts' gradients come
back through the all-to-alls' backward (the reverse exchange), summed over every token of the group that used them.
Every rank of the group must run the same number of MoE forwards and backwards, as under FSDP2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engines.model.sharded import chunk_rows, local_tensor


@dataclass(kw_only=True)
class ExpertShard:
    """Where an ``Experts`` block's experts live: ``size`` ranks of ``group``, this one ``rank`` of them, computing
    ``per_rank`` consecutive experts; ``dtype`` is the compute dtype its matrices are cast to (None: their own).
    ``replicas``: the ranks of the other expert-parallel groups that compute the same experts (None: no other); they
    store them sharded, whole experts apiece (``torch.chunk`` of the ``per_rank``), gathered for the forward and
    their gradients reduce-scattered in the backward (``gather_experts``), as FSDP2 does with the rest."""

    group: dist.ProcessGroup
    size: int
    rank: int
    per_rank: int
    dtype: torch.dtype | None = None
    replicas: dist.ProcessGroup | None = None
    #: bytes this rank sent other ranks through the all-to-alls (forward and backward), for ``take_sent``
    sent_bytes: int = 0

    def take_sent(self) -> int:
        """Bytes sent to other ranks through the all-to-alls since the last call (what a traffic plan predicts)."""
        n, self.sent_bytes = self.sent_bytes, 0
        return n


class _GatherExperts(torch.autograd.Function):
    """This rank's stored experts [c, ...] -> all ``per_rank`` experts of its place in the group, gathered from the
    replicas; the backward reduce-scatters (sums) their gradients back to each one's stored experts."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
        group = shard.replicas
        n, me = dist.get_world_size(group), dist.get_rank(group)
        counts = chunk_rows(shard.per_rank, n)
        ctx.shard, ctx.counts, ctx.me = shard, counts, me
        width = counts[0]
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[:local.shape[0]] = local
        out = local.new_empty((n * width, *local.shape[1:]))
        dist.all_gather_single(out, padded.contiguous(), group=group)
        return torch.cat([out[j * width:j * width + k] for j, k in enumerate(counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        counts, width = ctx.counts, ctx.counts[0]
        padded = grad.new_zeros((len(counts) * width, *grad.shape[1:]))
        start = 0
        for j, k in enumerate(counts):
            padded[j * width:j * width + k] = grad[start:start + k]
            start += k
        out = grad.new_empty((width, *grad.shape[1:]))
        dist.reduce_scatter_single(output=out, input=padded, group=ctx.shard.replicas)
        return out[:counts[ctx.me]], None


def gather_experts(local: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """The ``per_rank`` experts this rank computes, from its stored ones (themselves without replicas)."""
    return local if shard.replicas is None else _GatherExperts.apply(local, shard)


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split ``send`` ways out, ``recv`` ways in, over ``shard.group``; its backward is the reverse
    exchange. Sent as bytes, so any dtype crosses any backend."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], shard: ExpertShard) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.shard = send, recv, shard
        return _exchange(x, send, recv, shard)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.shard), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], shard: ExpertShard) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    row = math.prod(x.shape[1:]) * x.element_size()
    shard.sent_bytes += (sum(send) - send[shard.rank]) * row
    # as bytes: gloo's all-to-all takes no bfloat16; every rank calls it, even with nothing to move
    dist.all_to_all_single(out.view(torch.uint8).view(out.shape[0], row), x.contiguous().view(torch.uint8)
                           .view(x.shape[0], row), list(recv), list(send), group=shard.group)
    return out


class _Tie(torch.autograd.Function):
    """``out`` unchanged, with ``anchors`` made part of its graph (their gradient: zero). A rank whose experts got no
    rows, or whose tokens all went elsewhere, still runs the backward of every collective its peers run: the
    all-to-alls and the experts' reduce-scatter would otherwise wait for it forever (a dummy pass's two filler tokens
    reach a few experts only)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:
        ctx.anchors = [(a.shape, a.dtype, a.device) for a in anchors]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.anchors))


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], shard: ExpertShard) -> torch.Tensor:
    """Differentiable all-to-all of ``x``'s rows: ``send[r]`` rows to rank r, ``recv[r]`` from it."""
    return _AllToAll.apply(x, send, recv, shard)


def routed_forward(experts, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
                   slot_major: bool = False) -> torch.Tensor:
    """Σ_k weights[n, k] · expert_{index[n, k]}(x[n]) for this rank's tokens x [N, hidden], the experts spread over
    ``experts.shard`` (an ``ExpertShard``): a native ``Experts`` block, or transformers' stacked experts (gate_up_proj
    [E, 2I, H], down_proj [E, H, I], ``act_fn``), whose eager forward takes an expert's rows slot by slot
    (``slot_major``) where the native one takes them token by token.

    Every matmul is the one the unsharded forward runs on the token's own rank (expert e on that rank's rows of e, in
    the same order), and every sum is taken in its order, so on two ranks expert-parallel training equals FSDP2's bit
    for bit; on more, an expert's gradient sums the ranks' parts in another order than the reduce-scatter does
    (float32 rounding, nothing else).
    """
    shard: ExpertShard = experts.shard
    per, k = shard.per_rank, index.shape[1]
    flat = index.reshape(-1)
    if slot_major:
        n = index.shape[0]
        slot = torch.arange(k, device=flat.device).repeat(n)
        order = (flat * (k * n) + slot * n + torch.arange(n, device=flat.device).repeat_interleave(k)).argsort()
    else:
        order = flat.argsort(stable=True)
    token = order // k
    w = weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=experts.num_experts)
    # how many rows of each of my experts every rank sends me: [source rank, my expert]
    theirs = torch.empty_like(counts)
    dist.all_to_all_single(theirs, counts, group=shard.group)
    mine, got = counts.tolist(), theirs.view(shard.size, per).tolist()
    send = [sum(mine[r * per:(r + 1) * per]) for r in range(shard.size)]
    recv = [sum(row) for row in got]
    # 1. dispatch: each expert's rows gathered on their own (as the unsharded forward does), in expert order
    starts = [0, *torch.tensor(mine).cumsum(0).tolist()]
    parts = [x[token[starts[e]:starts[e + 1]]] for e in range(experts.num_experts) if mine[e]]
    rows = all_to_all(torch.cat(parts) if parts else x[:0], send, recv, shard)  # source-major, then expert
    # 2. my experts, each on each source's rows separately: the matmuls that source would have run itself
    fused = hasattr(experts, "gate_up_proj")
    act = getattr(experts, "act_fn", F.silu)
    mats = {n: gather_experts(local_tensor(getattr(experts, n)), shard) for n in
            (("gate_up_proj",) if fused else ("gate_proj", "up_proj")) + ("down_proj",)}
    each = {n: t.unbind(0) for n, t in mats.items()}  # one backward node per projection, not one per expert
    dtype = shard.dtype or x.dtype
    offset = [0, *torch.tensor([n for row in got for n in row]).cumsum(0).tolist()]
    outs: list = [None] * (shard.size * per)
    for e in range(per):
        if not any(got[s][e] for s in range(shard.size)):
            continue
        m = {n: t[e].to(dtype) for n, t in each.items()}
        for s in range(shard.size):
            if got[s][e]:
                h = rows[offset[s * per + e]:offset[s * per + e + 1]].to(dtype)
                if fused:
                    gate, up = F.linear(h, m["gate_up_proj"]).chunk(2, dim=-1)
                else:
                    gate, up = F.linear(h, m["gate_proj"]), F.linear(h, m["up_proj"])
                outs[s * per + e] = F.linear(act(gate) * up, m["down_proj"])
    done = [o for o in outs if o is not None]
    y = torch.cat(done) if done else rows[:0].to(dtype)  # empty, but in the graph (see _Tie)
    # 3. combine: every row back to its token's rank, in the order it was sent
    y = all_to_all(y, recv, send, shard)
    # 4. weigh and add, expert by expert, as the unsharded forward does
    out, start = torch.zeros_like(x), 0
    for e in range(experts.num_experts):
        n = mine[e]
        if n:
            out.index_add_(0, token[start:start + n], (y[start:start + n] * w[start:start + n, None]).to(out.dtype))
            start += n
    if not torch.is_grad_enabled():
        return out
    return _Tie.apply(out, y, *(t.reshape(-1)[:1] for t in mats.values()))
