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
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch


@dataclass
class RouteTape:
    """The routes of one forward: recorded (``record``) or to impose (``replay``), per MoE layer."""

    replay: torch.Tensor | None = None  # [tokens, layers, k] to impose, else None (recording)
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> [tokens, k]
    probs: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> mean router probabilities [E]
    entropy: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> mean per-token entropy (nats)


_tape: ContextVar[RouteTape | None] = ContextVar("route_tape", default=None)


def active() -> RouteTape | None:
    """The tape of the forward running on this thread, if any."""
    return _tape.get()


@contextmanager
def recording() -> Iterator[RouteTape]:
    """Record every MoE layer's routes (and its router's statistics) in the forwards run inside."""
    tape = RouteTape()
    token = _tape.set(tape)
    try:
        yield tape
    finally:
        _tape.reset(token)


@contextmanager
def replaying(routes: torch.Tensor) -> Iterator[RouteTape]:
    """Make every MoE layer take ``routes`` ([tokens, MoE layers, k] ints) in the forwards run inside; what the
    layers took is recorded too (a test compares the two)."""
    if routes.dim() != 3:
        raise ValueError(f"routes must be [tokens, MoE layers, k], got shape {tuple(routes.shape)}")
    tape = RouteTape(replay=routes.long())
    token = _tape.set(tape)
    try:
        yield tape
    finally:
        _tape.reset(token)


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


def note(tape: RouteTape, layer: int, index: torch.Tensor, probs: torch.Tensor) -> None:
    """Keep what MoE layer ``layer`` chose and its router's statistics (``probs``: [tokens, E] float32, the
    normalised scores the choice was made from)."""
    tape.recorded[layer] = index.detach()
    p = probs.detach()
    tape.probs[layer] = p.mean(dim=0)
    tape.entropy[layer] = -(p * p.clamp_min(1e-20).log()).sum(dim=-1).mean()


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
           "entropy": float(torch.stack(list(tape.entropy.values())).mean())}
    if reference is not None:
        out["route_mismatch"] = route_mismatch(stacked(tape), reference)
    return out


def route_mismatch(routes: torch.Tensor, reference: torch.Tensor) -> float:
    """The share of (token, layer) pairs of two [tokens, layers, k] route tensors whose expert sets differ."""
    if routes.shape != reference.shape:
        raise ValueError(f"route shapes differ: {tuple(routes.shape)} vs {tuple(reference.shape)}")
    if routes.numel() == 0:
        return 0.0
    a, b = routes.sort(dim=-1).values, reference.to(routes.device).long().sort(dim=-1).values
    return float((a != b).any(dim=-1).double().mean())
