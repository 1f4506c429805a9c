"""Mixture-of-experts feed-forward blocks: routers of each family, stacked experts, shared experts.

Experts are stored stacked, one [experts, rows, cols] tensor per projection (as transformers holds
them in memory), so the FSDP2 trainer shards whole experts across ranks and Muon sees each expert's
matrix as one matrix of a batch. Checkpoints keep one tensor per expert (``hub_placements``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.model.native import expert_dispatch, routing
from engines.model.native.arch import ModelConfig
from engines.model.native.layers import MLP


class Router(nn.Module):
    """Chooses ``top_k`` experts per token and their weights.

    ``softmax`` (Mixtral, Qwen3-MoE): softmax over all experts in float32, top-k, renormalised to sum
    to one where the family does (Mixtral always, Qwen3-MoE if ``norm_topk_prob``).
    ``sigmoid`` (DeepSeek-V3, Kimi K2): sigmoid scores in float32; experts are chosen on scores +
    ``e_score_correction_bias`` within the ``topk_group`` groups whose two best such scores sum highest;
    weights are the uncorrected scores of the chosen, renormalised if ``norm_topk_prob``, times
    ``routed_scaling_factor``. The bias only steers the choice and gets no gradient (see ``engines.training.optim``).
    Inside ``routing.replaying`` the experts are the replayed ones and the weights the same scores at them;
    inside ``routing.recording`` the choice is kept (``moe_index``: this layer's place among the MoE layers).
    """

    def __init__(self, cfg: ModelConfig, moe_index: int = 0) -> None:
        super().__init__()
        self.moe_index = moe_index
        self.kind = "sigmoid" if cfg.is_mla else "softmax"
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.num_experts
        self.renormalise = cfg.norm_topk_prob or cfg.model_type == "mixtral"
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if self.kind == "sigmoid":
            self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
            # float32 always, as DeepSeek keeps it: bf16 would round the small corrections away
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # ``model.to(bfloat16)`` casts floating buffers too: the bias stays float32 (see __init__)
        bias = getattr(self, "e_score_correction_bias", None)
        if bias is not None and bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] float32, expert indices [N, k]) for tokens x [N, hidden]."""
        tape = routing.active()
        replay = tape is not None and tape.replay is not None
        if self.kind == "softmax":
            probs = F.linear(x, self.weight).float().softmax(dim=-1)
            own = probs.topk(self.top_k, dim=-1)
            if replay:
                index = routing.take(tape, self.moe_index, probs.shape[0], self.top_k)
                weights = probs.gather(1, index)
            else:
                weights, index = own
            if tape is not None:
                routing.note(tape, self.moe_index, index, probs, own.indices if replay else None)
            if self.renormalise:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, index
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        own = self._grouped_top_k(scores)
        index = routing.take(tape, self.moe_index, scores.shape[0], self.top_k) if replay else own
        if tape is not None:
            routing.note(tape, self.moe_index, index, scores / scores.sum(dim=-1, keepdim=True),
                         own if replay else None)
        weights = scores.gather(1, index)
        if self.renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, index

    def _grouped_top_k(self, scores: torch.Tensor) -> torch.Tensor:
        """DeepSeek's choice: top-k of the bias-corrected scores within the best ``topk_group`` groups."""
        choice = scores + self.e_score_correction_bias
        per_group = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // self.n_group, dim=1), float("-inf"))
        return choice.topk(self.top_k, dim=-1, sorted=False).indices


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts, stacked: gate_proj/up_proj [E, I, H], down_proj [E, H, I]
    (``fused``: gate_up_proj [E, 2I, H], the inference layout, one matmul per expert)."""

    #: set by the trainer for expert-parallel training (``engines.training.expert_parallel``): then this rank computes
    #: some of the experts and tokens travel to them (``expert_dispatch``); a class default, so subclasses have it too
    shard: expert_dispatch.ExpertShard | None = None

    def __init__(self, num_experts: int, hidden: int, intermediate: int, fused: bool = False) -> None:
        super().__init__()
        self.num_experts, self.intermediate, self.fused = num_experts, intermediate, fused
        if fused:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        else:
            self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
            self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def matrix(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``e``'s matrix of projection ``name`` (an FP8 replica dequantises it here:
        ``engines.model.native.fp8``)."""
        return getattr(self, name)[e]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Σ_k weights[n, k] · expert_{index[n, k]}(x[n]) for tokens x [N, hidden]; each expert runs
        once on all the tokens routed to it, experts in ascending order (so sums add up in a fixed order)."""
        if self.shard is not None:
            return expert_dispatch.routed_forward(self, x, weights, index)
        out = torch.zeros_like(x)
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // index.shape[1]
        w = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token[start:start + n]
            h = x[rows]
            if self.fused:
                gate, up = F.linear(h, self.matrix("gate_up_proj", e, h.dtype)).chunk(2, dim=-1)
            else:
                gate = F.linear(h, self.matrix("gate_proj", e, h.dtype))
                up = F.linear(h, self.matrix("up_proj", e, h.dtype))
            y = F.linear(F.silu(gate) * up, self.matrix("down_proj", e, h.dtype))
            out.index_add_(0, rows, (y * w[start:start + n, None]).to(out.dtype))
            start += n
        return out


class MoE(nn.Module):
    """Router + routed experts (+ always-on shared experts, DeepSeek-V3/Kimi K2)."""

    def __init__(self, cfg: ModelConfig, fused: bool = False, moe_index: int = 0) -> None:
        super().__init__()
        inter = cfg.moe_intermediate_size or cfg.intermediate_size
        # Mixtral checkpoints call this block ``block_sparse_moe`` and the expert matrices w1/w3/w2
        self.hub_alias = "block_sparse_moe" if cfg.model_type == "mixtral" else None
        self.hub_names = {"gate": "w1", "up": "w3", "down": "w2"} if cfg.model_type == "mixtral" else \
            {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        self.gate = Router(cfg, moe_index)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, inter, fused)
        self.shared_experts = MLP(cfg.hidden_size, inter * cfg.n_shared_experts, fused=fused) \
            if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, index = self.gate(flat)
        out = self.experts(flat, weights, index).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def hub_placements(self) -> list[tuple[str, str, int, tuple[int, ...]]]:
        """Expert e's matrices are one tensor each in a checkpoint (``experts.{e}.gate_proj.weight``):
        (checkpoint name, own parameter, element offset, shape), names relative to this block."""
        ex, n = self.experts, self.hub_names
        hidden, inter = ex.down_proj.shape[1], ex.intermediate
        size, shape = hidden * inter, (inter, hidden)
        out = []
        for e in range(ex.num_experts):
            stem = f"experts.{e}."
            if ex.fused:
                out += [(stem + n["gate"] + ".weight", "experts.gate_up_proj", 2 * e * size, shape),
                        (stem + n["up"] + ".weight", "experts.gate_up_proj", (2 * e + 1) * size, shape)]
            else:
                out += [(stem + n["gate"] + ".weight", "experts.gate_proj", e * size, shape),
                        (stem + n["up"] + ".weight", "experts.up_proj", e * size, shape)]
            out.append((stem + n["down"] + ".weight", "experts.down_proj", e * size, (hidden, inter)))
        return out
