"""Routing replay and router health: what each MoE layer chose, recorded or imposed.

A forward inside ``recording()`` leaves, for every MoE layer it ran (numbered 0.. in depth order among the MoE layers,
``MoE.moe_index``), the experts each token took: an int [tokens, k] tensor, tokens in the forward's flattened order.
A forward inside ``replaying(routes)`` makes each MoE layer take ``routes[:, layer]`` (an int [tokens, layers, k]
tensor, the layout of ``Sample.routed_experts``) instead of its own top-k; the gates are still the router's own
scores at those experts (softmax or sigmoid, renormalised and scaled as the family does), so gradients reach the
router and only the choice is the recorded one (rollout routing replay). Keyed by layer, not by call order: a
recomputed forward (activation checkpointing) replays the same routes.

``router_health`` turns a recording (and the router's probabilities) into the metrics that show a router
collapsing: load balance, the most loaded expert's share, the router's entropy, and the share of tokens whose
routes differ from a reference recording.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch


@dataclass
class RouteTape:
    """The routes of one forward: recorded (``record``) or to impose (``replay``), per MoE layer."""

    replay: torch.Tensor | None = None  # [tokens, layers, k] to impose, else None (recording)
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> [tokens, k]
    entropy: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> per-token router entropy (nats)
    own: dict[int, torch.Tensor] = field(default_factory=dict)  # under replay: the layer's own top-k [tokens, k]


_tape: ContextVar[RouteTape | None] = ContextVar("route_tape", default=None)


def active() -> RouteTape | None:
    """The tape of the forward running on this thread, if any."""
    return _tape.get()


def recording() -> AbstractContextManager[RouteTape]:
    """Record every MoE layer's routes (and its router's statistics) in the forwards run inside."""
    return using(RouteTape())


def replaying(routes: torch.Tensor) -> AbstractContextManager[RouteTape]:
    """Make every MoE layer take ``routes`` ([tokens, MoE layers, k] ints) in the forwards run inside; what the
    layers took is recorded too (a test compares the two)."""
    if routes.dim() != 3:
        raise ValueError(f"routes must be [tokens, MoE layers, k], got shape {tuple(routes.shape)}")
    return using(RouteTape(replay=routes.long()))


@contextmanager
def using(tape: RouteTape | None) -> Iterator[RouteTape | None]:
    """Run the forwards inside under ``tape`` (a recomputed layer under activation checkpointing re-enters the tape
    its first forward ran under: the backward runs outside any ``replaying`` block)."""
    token = _tape.set(tape)
    try:
        yield tape
    finally:
        _tape.reset(token)


def check_routes(routes, layers: int, top_k: int, num_experts: int) -> None:
    """Refuse, in one line, routes (an int [tokens, layers, k] array, on the host) that do not fit a model with
    ``layers`` MoE layers of ``num_experts`` experts and top-``top_k`` routing (checked once on the host, so the
    forward itself never reads the device)."""
    shape = tuple(routes.shape)
    if len(shape) != 3 or shape[1] != layers or shape[2] != top_k:
        raise ValueError(f"routes of shape {shape} do not fit this model: [tokens, {layers} MoE layers, top-{top_k}]")
    if shape[0] and (int(routes.min()) < 0 or int(routes.max()) >= num_experts):
        raise ValueError(f"routes name experts outside 0..{num_experts - 1}")


def take(tape: RouteTape, layer: int, tokens: int, top_k: int) -> torch.Tensor:
    """The experts MoE layer ``layer`` must use for its ``tokens`` tokens, from the tape's replayed routes (shapes
    checked: metadata only, no device read)."""
    r = tape.replay
    assert r is not None
    if layer >= r.shape[1] or r.shape[0] != tokens or r.shape[2] != top_k:
        raise ValueError(f"replayed routes of shape {tuple(r.shape)} do not fit MoE layer {layer} with {tokens} "
                         f"tokens and top-{top_k} routing")
    return r[:, layer]


def note(tape: RouteTape, layer: int, index: torch.Tensor, probs: torch.Tensor,
         own: torch.Tensor | None = None) -> None:
    """Keep what MoE layer ``layer`` used, its router's per-token entropy (``probs``: [tokens, E] float32, the
    normalised scores) and, under replay, the experts it would have chosen itself (``own``)."""
    tape.recorded[layer] = index.detach()
    p = probs.detach()
    tape.entropy[layer] = -(p * p.clamp_min(1e-20).log()).sum(dim=-1)
    if own is not None:
        tape.own[layer] = own.detach()


def stacked(tape: RouteTape) -> torch.Tensor:
    """The recorded routes as one [tokens, MoE layers, k] tensor (``Sample.routed_experts``' layout)."""
    if not tape.recorded:
        raise ValueError("no MoE layer ran in this recording")
    return torch.stack([tape.recorded[i] for i in sorted(tape.recorded)], dim=1)


def router_health(tape: RouteTape, num_experts: int, reference: torch.Tensor | None = None) -> dict[str, float]:
    """Router metrics of a recording, averaged over MoE layers:

    - ``load_cv``: coefficient of variation (std / mean) of the tokens each expert received (0: perfectly even);
    - ``max_load``: the most loaded expert's share of all routed slots, over the even share 1/E (1: even);
    - ``entropy``: the router's mean per-token entropy over its normalised scores, in nats;
    - ``route_mismatch`` (with ``reference``, [tokens, layers, k]): the share of token-layer pairs whose chosen
      experts (as a set) differ from the reference's.
    """
    if not tape.recorded:
        return {}
    cvs, maxes = [], []
    for idx in tape.recorded.values():
        load = torch.bincount(idx.reshape(-1), minlength=num_experts).double()
        mean = load.mean()
        cvs.append(float(load.std(unbiased=False) / mean) if mean > 0 else 0.0)
        maxes.append(float(load.max() / load.sum() * num_experts) if load.sum() > 0 else 0.0)
    out = {"load_cv": sum(cvs) / len(cvs), "max_load": max(maxes),
           "entropy": float(torch.stack([e.mean() for e in tape.entropy.values()]).mean())}
    if reference is not None:
        out["route_mismatch"] = route_mismatch(stacked(tape), reference)
    return out


def route_mismatch(routes: torch.Tensor, reference: torch.Tensor) -> float:
    """The share of (token, layer) pairs of two [tokens, layers, k] route tensors whose expert sets differ."""
    if routes.shape != reference.shape:
        raise ValueError(f"route shapes differ: {tuple(routes.shape)} vs {tuple(reference.shape)}")
    if routes.numel() == 0:
        return 0.0
    return float(_differ(routes, reference.to(routes.device).long()).double().mean())


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token (and layer), whether two [..., k] expert choices differ as sets."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


class RouterTally:
    """Router health summed on the device over a step's forwards, read with the step's one host read: tokens per
    expert in each MoE layer, the routers' entropy, and (under replay) how many token-layer pairs the trainer would
    have routed otherwise than the rollout did. ``flat`` is what crosses ranks and the read; ``metrics`` names it."""

    def __init__(self, layers: int, experts: int, device: torch.device | str) -> None:
        self.layers, self.experts = layers, experts
        self.loads = torch.zeros(layers, experts, dtype=torch.float64, device=device)
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # entropy, tokens, differing, compared

    def add(self, tape: RouteTape, keep: torch.Tensor) -> None:
        """Count one forward's real tokens (``keep``: bool per token of the forward; filler is left out)."""
        w = keep.double()
        for layer, index in tape.recorded.items():
            self.loads[layer].index_add_(0, index.reshape(-1), w.repeat_interleave(index.shape[1]))
            self.sums[0] += (tape.entropy[layer].double() * w).sum()
            self.sums[1] += w.sum()
            if layer in tape.own:
                self.sums[2] += (_differ(index, tape.own[layer]).double() * w).sum()
                self.sums[3] += w.sum()

    def flat(self) -> torch.Tensor:
        return torch.cat((self.loads.flatten(), self.sums))

    def metrics(self, values: list[float]) -> dict[str, float]:
        """``flat``'s values, read and reduced over ranks, as ``router_health``'s metrics averaged over layers."""
        loads = torch.tensor(values[: self.layers * self.experts], dtype=torch.float64).view(self.layers, -1)
        entropy, tokens, differing, compared = values[self.layers * self.experts:]
        if not tokens:
            return {}
        mean = loads.mean(dim=1).clamp_min(1e-20)
        out = {"router_load_cv": float((loads.std(dim=1, unbiased=False) / mean).mean()),
               "router_max_load": float((loads.max(dim=1).values / mean).max()),
               "router_entropy": entropy / tokens}
        if compared:
            out["route_mismatch"] = differing / compared
        return out
