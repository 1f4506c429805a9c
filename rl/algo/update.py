"""The policy update on one trainer rank: its share of the batch as device tensors, scored, corrected, stepped.

The objective (K1.5 by default, or GRPO/DAPO) is in ``rl.algo.objectives``; the driver has planned the update
(``rl.algo.batches``: advantages, weights, minibatches, micro-batches). Here a rank turns its samples into tensors once
(``to_device``: each micro-batch packed and uploaded, with its own-token mask, the sampler's log-probs, π_old,
advantages and weights), optionally recomputes π_old with the trainer's weights and corrects the train–inference
mismatch (``rl.algo.mismatch``), scores the reference policy once (a KL penalty), then runs one optimizer step per
minibatch. Losses and diagnostics accumulate on the device and, reduced over ranks, are read with the optimizer step's
one host read (``TrainingEngine.reads``); a step's update RMS comes back with the next step's read, so each step's
metrics are yielded once the next step has run (the last step's after one final read). With FSDP every
forward/backward is collective: each rank runs as many passes as the busiest rank (``RankBatch.passes``), padding with
dummy passes. Total loss of a step: L_RL + λ_ptx·L_PTX, the PTX part the token-mean NLL of curated responses.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from engines.device import to_device as upload
from engines.model.hf.vision import DocumentMedia, PackedMedia, pack_media
from engines.model.images import ImageRef
from engines.model.native import routing
from engines.model.native.causal_lm import CausalLM
from engines.model.text.processor import Expanded
from engines.training.distributed import all_reduce_tensor
from engines.training.engine import NonFiniteError, StepMetrics, TokenScores, TrainingEngine, inverse_temperatures
from engines.training.packing import PackedBatch, pack
from engines.training.routes import pack_routes
from rl.algo.batches import PtxShare, RankBatch
from rl.algo.mismatch import correct
from rl.algo.mismatch import metrics as correction_metrics
from rl.algo.objectives import Objective, clip_fraction, clipped_surrogate, k15_loss, kl_to_reference, token_weights
from rl.sample import image_positions
from rl.settings import UpdateSettings


@dataclass(kw_only=True)
class Micro:
    """One micro-batch of a rank's samples on the device; per-sequence tensors are [B, longest response]."""

    index: list[int]          # the samples (positions in ``RankBatch.samples``)
    packed: PackedBatch
    inv_temp: torch.Tensor    # 1/T per target
    own: torch.Tensor         # bool: the model's own response tokens (a multi-turn loss mask leaves the env's out)
    sampler: torch.Tensor     # the sampler's log-probs
    old: torch.Tensor         # log π_old per token: the sampler's, or the trainer's recompute
    old_seq: torch.Tensor     # [B] log π_old of each sequence's own tokens
    advantage: torch.Tensor   # [B]
    weight: torch.Tensor      # [B] loss weight, times any mismatch correction
    ref: torch.Tensor | None = None  # the reference policy's log-probs (a KL penalty)
    routes: torch.Tensor | None = None  # MoE routing replay: the rollout's experts per packed token
    media: PackedMedia | None = None  # a vision-language model: the samples' images as its forward takes them

    def score(self, engine: TrainingEngine, router: routing.RouterTally | None = None) -> TokenScores:
        """The trainer's log-probs and entropies of this micro-batch (differentiable unless under no_grad); with
        ``routes``, every MoE layer takes the rollout's experts (π_θ, π_old and the reference alike). ``router``
        (an MoE policy) counts its routers' health over this forward's tokens."""
        tape = routing.replaying(self.routes) if self.routes is not None else \
            routing.recording() if router is not None else nullcontext()
        with tape as routes:
            scores = engine.score_packed(self.packed, self.inv_temp, self.media)
        if router is not None:
            # the tokens the rollout read: real ones, each sequence's last one aside (never read, its replayed route
            # a stand-in); a sequence lies in one row, so the next flat position is the next token or another's
            doc = self.packed.mask.doc.flatten()
            router.add(routes, (doc >= 0) & (doc == torch.cat((doc[1:], doc.new_full((1,), -1)))))
        self.packed.mask.clear_cache()  # the dense or block mask: built again next pass, not held meanwhile
        return scores


def _rows(values: Sequence[Sequence[float | int]], width: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(len(values), width, dtype=dtype)
    for b, row in enumerate(values):
        out[b, :len(row)] = torch.as_tensor(row, dtype=dtype)
    return out


def to_device(engine: TrainingEngine, batch: RankBatch) -> list[list[Micro]]:
    """Every planned micro-batch of ``batch`` as tensors on the engine's device, per optimizer step (packed and
    uploaded once, without waiting for the device)."""
    dev, out = engine.device, []
    expanded: dict = {}  # a group's samples share their prompt and images: the processor runs once per group
    for parts in batch.steps:
        step = []
        for part in parts:
            chosen = [batch.samples[i] for i in part]
            prompts, media, turns = expand_images(engine, chosen, expanded)
            # each response as the model reads it: a multi-turn one with observation images expanded, the rest as is
            responses, masks, logprobs = zip(*(
                (t.response_ids, t.loss_mask, t.logprobs) if t else
                (s.response_ids, s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids), s.logprobs)
                for s, t in zip(chosen, turns, strict=True)), strict=True)
            host = pack(prompts, list(responses), engine.pad_id, engine.attention)
            inv = torch.tensor(inverse_temperatures([s.temperature for s in chosen], len(chosen)),
                               dtype=torch.float32)[host.target_seq]
            width = max(len(r) for r in responses)
            own = _rows(masks, width, torch.bool)
            sampler = upload(_rows(logprobs, width, torch.float32), dev)
            step.append(Micro(
                index=part, packed=host.to(dev), inv_temp=upload(inv, dev), own=upload(own, dev), sampler=sampler,
                old=sampler,
                old_seq=upload(torch.tensor([s.policy_logprob() for s in chosen], dtype=torch.float32), dev),
                advantage=upload(torch.tensor([batch.advantages[i] for i in part], dtype=torch.float32), dev),
                weight=upload(torch.tensor([batch.weights[i] for i in part], dtype=torch.float32), dev),
                routes=_routes(engine, host, chosen),
                media=None if media is None else pack_media(host.mask, media).to(dev)))
        out.append(step)
    return out


@dataclass
class ExpandedTurns:
    """A multi-turn sample whose observations show images, as the model reads it: the response with each
    observation image's placeholder expanded, and its loss mask and sampler log-probs laid out to match (0 on the
    image tokens)."""

    response_ids: list[int]
    loss_mask: np.ndarray
    logprobs: np.ndarray


def expand_images(engine: TrainingEngine, chosen: Sequence, cache: dict | None = None
                  ) -> tuple[list, list[DocumentMedia | None] | None, list[ExpandedTurns | None]]:
    """The prompts the model reads and their images: each sample's template ids with its image placeholders
    expanded by the model's processor (``engine.processor``), and its images' tensors; text-only samples as they
    are (media None when no sample has images). A sample whose observations show images also gets its response
    expanded (``ExpandedTurns``; None for the others). ``cache`` keeps prompt expansions across calls."""
    turns: list[ExpandedTurns | None] = [None] * len(chosen)
    if not any(s.images for s in chosen):
        return [s.prompt_ids for s in chosen], None, turns
    vp = engine.processor
    if vp is None:
        raise ValueError("samples carry images, but the policy is a text-only model")
    prompts, media = [], []
    for j, s in enumerate(chosen):
        if not s.images:
            prompts.append(s.prompt_ids)
            media.append(None)
            continue
        ids = s.prompt_ids.tolist()
        if vp.placeholders(ids) < len(s.images):  # images in the observations too: the whole conversation
            e, turns[j] = _expand_turns(vp, s)
            prompts.append(e.ids[:len(e.ids) - len(turns[j].response_ids)])
            media.append(DocumentMedia(e.media, e.mm_token_type_ids))
            continue
        key = (tuple(ids), *(im.identity() if isinstance(im, ImageRef) else id(im) for im in s.images))
        e = cache.get(key) if cache is not None else None
        if e is None:
            e = vp.expand(ids, s.images, f"sample {s.key}")
            if cache is not None:
                cache[key] = e
        prompts.append(e.ids)
        media.append(DocumentMedia(e.media, e.mm_token_type_ids))
    return prompts, media, turns


def _expand_turns(vp, s) -> tuple[Expanded, ExpandedTurns]:
    """The whole conversation of ``s`` expanded (prompt and observations' images, in order), and its response."""
    p = len(s.prompt_ids)
    own = s.loss_mask if s.loss_mask is not None else np.ones(len(s.response_ids), dtype=bool)
    ids = [*s.prompt_ids.tolist(), *s.response_ids.tolist()]
    e = vp.expand(ids, s.images, f"sample {s.key}", at=image_positions(vp.image_token_id, ids, p, own))
    origin = np.asarray(e.origin)
    tail = origin[origin >= p] - p  # each response token's original position (an image's: its placeholder's)
    return e, ExpandedTurns(e.ids[len(e.ids) - len(tail):], np.asarray(own)[tail], np.asarray(s.logprobs)[tail])


def _moe_shape(engine: TrainingEngine) -> tuple[int, int] | None:
    """(MoE layers, experts) of a native MoE policy, whose routers' health the update counts; else None."""
    if not isinstance(engine.model, CausalLM) or not engine.model.config.is_moe:
        return None  # a transformers model's routers are its own: neither counted nor replayed
    cfg = engine.model.config
    return sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers))), cfg.num_experts


def _routes(engine: TrainingEngine, host: PackedBatch, chosen: Sequence) -> torch.Tensor | None:
    """The micro-batch's rollout routes laid out as its packed tokens, on the device, when its samples carry them
    (the rollout engine recorded them: ``algorithm.routing_replay``), else None."""
    if not chosen or all(s.routed_experts is None for s in chosen):
        return None
    shape = _moe_shape(engine)
    if shape is None:
        raise ValueError("samples carry MoE routes, but the policy is not a native MoE model to replay them in")
    routes = pack_routes(host, [s.routed_experts for s in chosen], shape[0], engine.model.config.num_experts_per_tok,
                         shape[1])
    return upload(routes, engine.device)


class Measures:
    """Diagnostics gathered while training, as device sums; ``read`` reduces them over ranks and reads them once.

    ``logprob_diff``: |log π_trainer − log π_sampler| per own token, measured before any optimizer step of the
    iteration; ``entropy``: of the policy at each token's sampling temperature, same tokens; ``residual``: the K1.5
    residual A − τ·(log π_θ − log π_old) per sequence; ``clip``: GRPO/DAPO's clipped share; ``kl_ref``: the KL
    penalty's estimate; the losses of the step; a mismatch correction's partial sums (``rl.algo.mismatch``).
    """

    SUMS = ("loss", "ptx_loss", "diff", "entropy", "tokens", "residual", "residual_sq", "sequences", "clipped",
            "scored", "kl", "kl_tokens", "rho_sum", "rho_n", "is_hit", "is_units")
    MAXIMA = ("diff_max", "residual_absmax", "neg_rho_min", "rho_max")

    def __init__(self, device: torch.device, router: tuple[int, int] | None = None) -> None:
        self.sums = torch.zeros(len(self.SUMS), dtype=torch.float64, device=device)
        self.maxima = torch.full((len(self.MAXIMA),), float("-inf"), dtype=torch.float64, device=device)
        #: an MoE policy's (MoE layers, experts): its routers' health is counted too (``routing.RouterTally``)
        self.router = routing.RouterTally(*router, device) if router is not None else None

    def add(self, **values: torch.Tensor | float) -> None:
        for k, v in values.items():
            self.sums[self.SUMS.index(k)] += v.detach().double() if isinstance(v, torch.Tensor) else v

    def top(self, **values: torch.Tensor) -> None:
        for k, v in values.items():
            i = self.MAXIMA.index(k)
            self.maxima[i] = torch.maximum(self.maxima[i], v.detach().double())

    def add_tokens(self, micro: Micro, scores: TokenScores) -> None:
        own = micro.own & scores.mask
        diff = torch.where(own, (scores.logprobs.detach() - micro.sampler).abs(), 0.0)
        self.add(diff=diff.sum(), entropy=torch.where(own, scores.entropy, 0.0).sum(), tokens=own.sum())
        self.top(diff_max=diff.max() if diff.numel() else diff.new_zeros(()))

    def add_residuals(self, residuals: torch.Tensor) -> None:
        r = residuals.detach().double()
        self.add(residual=r.sum(), residual_sq=(r * r).sum(), sequences=float(r.numel()))
        if r.numel():
            self.top(residual_absmax=r.abs().max())

    def add_correction(self, stats: torch.Tensor) -> None:
        """A mismatch correction's partial sums (in ``rl.algo.mismatch.correct``'s order)."""
        self.add(rho_sum=stats[0], rho_n=stats[1], is_hit=stats[2], is_units=stats[3])
        self.top(neg_rho_min=-stats[4], rho_max=stats[5])

    def reduced(self) -> torch.Tensor:
        """Every value, reduced over ranks (sums summed, maxima maximised), in one device tensor (no host read)."""
        parts = [all_reduce_tensor(self.sums, "sum"), all_reduce_tensor(self.maxima, "max")]
        if self.router is not None:
            parts.append(all_reduce_tensor(self.router.flat(), "sum"))
        return torch.cat(parts)

    def named(self, values: Sequence[float]) -> dict[str, float]:
        """``reduced``'s values, read to the host, by name (the router's as ``RouterTally.metrics`` names them)."""
        n = len(self.SUMS) + len(self.MAXIMA)
        out = dict(zip(self.SUMS + self.MAXIMA, values[:n], strict=True))
        if self.router is not None:
            out.update(self.router.metrics(list(values[n:])))
        return out

    def read(self) -> dict[str, float]:
        """Every value, reduced over ranks: one read of the device."""
        return self.named(self.reduced().tolist())


def _metrics(v: dict[str, float], tokens: bool, residuals: bool, correction) -> dict[str, float]:
    out = {"loss": v["loss"]}
    if tokens and v["tokens"]:
        out.update(logprob_diff_mean=v["diff"] / v["tokens"], logprob_diff_max=max(v["diff_max"], 0.0),
                   entropy=v["entropy"] / v["tokens"])
    if residuals and v["sequences"]:
        mean = v["residual"] / v["sequences"]
        out.update(k15_residual_mean=mean, k15_residual_std=max(0.0, v["residual_sq"] / v["sequences"] - mean * mean)
                   ** 0.5, k15_residual_absmax=v["residual_absmax"])
    if residuals and v["scored"]:
        out["clip_fraction"] = v["clipped"] / v["scored"]
    if residuals and v["kl_tokens"]:
        out["kl_ref"] = v["kl"] / v["kl_tokens"]
    out.update({k: x for k, x in v.items() if k.startswith(("router_", "route_"))})
    if correction is not None and v["rho_n"]:
        out.update(correction_metrics([v["rho_sum"], v["rho_n"], v["is_hit"], v["is_units"], -v["neg_rho_min"],
                                       v["rho_max"]], correction))
    return out


@torch.no_grad()
def score_all(engine: TrainingEngine, steps: list[list[Micro]], passes: int, measures: Measures | None = None,
              into: str = "old") -> None:
    """Score every micro-batch once with ``engine``'s weights into ``Micro.old`` (π_old recomputed by the trainer,
    as verl does) or ``Micro.ref`` (the reference policy); dummy forwards pad to ``passes``."""
    n = 0
    for micro in (m for step in steps for m in step):
        scores = micro.score(engine)
        if measures is not None:
            measures.add_tokens(micro, scores)
        if into == "old":
            micro.old = scores.logprobs.float()
            micro.old_seq = (micro.old * micro.own).sum(-1)
        else:
            micro.ref = scores.logprobs.float()
        n += 1
    for _ in range(passes - n):
        engine.dummy_forward()


def correct_mismatch(steps: list[list[Micro]], settings: UpdateSettings, measures: Measures,
                     tokens: list[int]) -> list[torch.Tensor | int]:
    """Reweight (or mask) each micro-batch's samples by their ratio trainer/sampler after a recompute; returns each
    step's own tokens over all ranks, counted again where token-level MIS masked some out."""
    how = settings.correction
    for micro in (m for step in steps for m in step):
        factor, micro.own, stats = correct(micro.old, micro.sampler, micro.own, how)
        micro.weight = micro.weight * factor
        micro.old_seq = (micro.old * micro.own).sum(-1)
        measures.add_correction(stats)
    if how.kind != "mis" or how.level != "token":
        return list(tokens)
    return [all_reduce_tensor(sum((m.own.sum() for m in step), torch.zeros((), dtype=torch.long,
                                                                        device=measures.sums.device)), "sum")
            for step in steps]


def accumulate(engine: TrainingEngine, micros: list[Micro], passes: int, objective: Objective,
               total_tokens: torch.Tensor | int, measures: Measures, measure_tokens: bool = False) -> None:
    """Accumulate the gradient of one step's RL loss over this rank's ``micros`` (dummy backwards pad to
    ``passes``); its loss and diagnostics go to ``measures``."""
    for micro in micros:
        scores = micro.score(engine, measures.router)
        own = micro.own & scores.mask
        if objective.kind == "k15":
            new = (scores.logprobs * own).sum(-1)
            loss = k15_loss(new, micro.old_seq, micro.advantage, micro.weight, objective.tau)
            measures.add_residuals(micro.advantage - objective.tau * (new.detach() - micro.old_seq))
        else:
            coef = token_weights(objective.kind, own, micro.weight, total_tokens)
            loss = clipped_surrogate(scores.logprobs, micro.old, micro.advantage, coef, objective.clip_low,
                                     objective.clip_high)
            if objective.kl_coef:
                kl = kl_to_reference(scores.logprobs, micro.ref) * own
                loss = loss + objective.kl_coef * (coef * kl).sum()
                measures.add(kl=kl.sum(), kl_tokens=own.sum())
            clipped, scored = clip_fraction(scores.logprobs, micro.old, micro.advantage, own, objective.clip_low,
                                            objective.clip_high)
            measures.add(clipped=clipped, scored=scored)
        loss.backward()
        measures.add(loss=loss)
        if measure_tokens:
            measures.add_tokens(micro, scores)
    for _ in range(passes - len(micros)):
        engine.dummy_backward()


def nll_loss(engine: TrainingEngine, prompts, responses, n_tokens: int) -> torch.Tensor:
    """Summed NLL of the response tokens divided by ``n_tokens`` (token-mean over a minibatch)."""
    lp, _ = engine.response_logprobs(prompts, responses, temperature=1.0)
    return -lp.sum() / n_tokens


def ptx_accumulate(engine: TrainingEngine, share: PtxShare, coef: float, measures: Measures) -> None:
    """Accumulate the gradient of coef · (token-mean NLL over the step's whole PTX batch) over this rank's share;
    normalised by the batch's response tokens over all ranks, so the split does not matter."""
    for part in share.parts:
        loss = coef * nll_loss(engine, [share.prompts[i] for i in part], [share.responses[i] for i in part],
                               share.tokens)
        loss.backward()
        measures.add(ptx_loss=loss / coef)
    for _ in range(share.passes - len(share.parts)):
        engine.dummy_backward()


def rl_update(engine: TrainingEngine, batch: RankBatch, settings: UpdateSettings,
              reference: TrainingEngine | None = None) -> Iterator[dict[str, float]]:
    """Several optimizer steps on this rank's share of one rollout batch (``rl.algo.batches.plan_update``), one per
    minibatch of whole prompt groups; yields each step's metrics, reduced over ranks, as it completes (the first
    step's also carry the iteration's diagnostics and counts). ``recompute_old`` replaces the sampler's log π_old by
    the trainer's before the first step; a ``correction`` then reweights (or masks) each sample by its ratio
    trainer/sampler. With a KL penalty, ``reference`` (the reference policy's engine) scores the samples once."""
    objective = settings.objective
    steps = to_device(engine, batch)
    router = _moe_shape(engine)
    pre = Measures(engine.device, router)
    tokens: list[torch.Tensor | int] = list(batch.tokens)
    if settings.recompute_old and batch.samples:
        score_all(engine, steps, batch.scoring_passes, pre)
        if settings.correction is not None:
            tokens = correct_mismatch(steps, settings, pre, batch.tokens)
    if objective.kl_coef and batch.samples:
        if reference is None:
            raise ValueError("a KL penalty (kl_coef) needs the reference policy's engine")
        score_all(reference, steps, batch.scoring_passes, into="ref")
    held: tuple[dict[str, float], StepMetrics] | None = None  # the last step's metrics, short of its update RMS
    for j, micros in enumerate(steps):
        measures = pre if j == 0 else Measures(engine.device, router)
        accumulate(engine, micros, batch.passes[j], objective, tokens[j], measures,
                   measure_tokens=j == 0 and not settings.recompute_old)
        if batch.ptx and batch.ptx[j] is not None:
            ptx_accumulate(engine, batch.ptx[j], settings.ptx_coef, measures)
        read = engine.reads.defer(measures.reduced())
        try:
            grad_norm = engine.step()  # the one read: this step's losses, the last step's update RMS
        except NonFiniteError:
            if held is not None:  # its values were read before the refusal: the completed steps are reported
                yield _completed(*held)
            raise
        if held is not None:
            yield _completed(*held)
        values = measures.named(read.values)
        metrics = _metrics(values, tokens=j == 0, residuals=batch.passes[j] > 0,
                           correction=settings.correction if j == 0 else None)
        if batch.ptx and batch.ptx[j] is not None:
            metrics["ptx_loss"] = values["ptx_loss"]
        if j == 0:
            metrics.update(batch.counts)
        metrics["grad_norm"] = grad_norm
        held = metrics, engine.step_metrics
    if held is not None:
        yield _completed(*held)  # the iteration's last read: the last step's update RMS


def _completed(metrics: dict[str, float], step: StepMetrics) -> dict[str, float]:
    metrics.update(step.as_dict())
    return metrics


def sft_update(engine: TrainingEngine, prompts: Sequence[list[int]], responses: Sequence[list[int]],
               micro_batch: int) -> dict[str, float]:
    """One optimizer step of supervised fine-tuning on reference responses."""
    n_tokens = sum(len(r) for r in responses)
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    for start in range(0, len(prompts), micro_batch):
        loss = nll_loss(engine, prompts[start : start + micro_batch], responses[start : start + micro_batch],
                        n_tokens)
        loss.backward()
        total += loss.detach()
    loss = engine.reads.defer(total)
    grad_norm = engine.step()  # reads the loss too
    return {"loss": loss.values[0], "grad_norm": grad_norm}
