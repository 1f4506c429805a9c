"""What a run's vLLM replica checks of itself as it starts: that it can serve the model, and that an in-place weight
update reaches its kernels as the trainer's weights.

A model family may load in vLLM and still fail at its first forward (vLLM's CPU build lacks Mamba-1's selective-scan
kernel), or serve a fresh load correctly and an in-place update wrongly (vLLM 0.32's CPU fused-MoE kernel read
reloaded experts in the wrong layout until ``engines.inference.vllm_worker`` packed them: docs/models.md, "MoE
models"). Which families work changes with vLLM, so instead of a list of families measured by hand, the replica
measures its own model when it starts (``check_replica``):

1. it scores a few probe tokens (any failure of the model's forward is the start-up's one-line error);
2. where its layers are rebuilt on an update (``weight_load`` "reload": fused MoE, latent attention) and it keeps a
   host copy (a CPU replica), it takes two in-place updates through the path every later update takes
   (``load_weights``: the worker's streamed reload): to a perturbed copy of its weights (every tensor moved, the
   router's choices too) and back to the trainer's initial weights; after each it scores the probe again, and the
   trainer's model code (the native model of a native family, else transformers') scores it on the same weights.

The replica refuses to start, in one line naming the model type and the measured difference
(``ReplicaCheckError``), when an update leaves vLLM further from the trainer than ``TOLERANCE`` (float32 rounding;
an update that misses a tensor is off by order 1) or than its own fresh load is, whichever is larger (a bfloat16
replica's kernels differ from the float32 recompute by about 1e-2 at best).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

#: how far vLLM's log-probs may be from the trainer's after an in-place update (float32; both engines, their own
#: kernels: the families served so far agree to 2.1e-5 at most, docs/models.md)
TOLERANCE = 1e-4
#: probe tokens scored after each update (a fixed draw: the check is the same on every start)
PROBE_TOKENS = 32
#: the perturbed copy's relative noise: far enough that an update which misses a tensor shows
NOISE = 0.25


class ReplicaCheckError(RuntimeError):
    """The replica cannot serve the run: the message (one line) names the model type and the cause."""


@dataclass(frozen=True)
class UpdateCheck:
    """What the check measured: max |log π_vLLM − log π_trainer| over the probe after the fresh load, after an
    update to a perturbed copy, and after the update back to the trainer's weights; how far the perturbed copy moved
    vLLM's log-probs (an update that changed nothing would pass the rest against stale weights); the probe's length."""

    fresh: float
    perturbed: float
    restored: float
    shift: float
    tokens: int

    @property
    def worst(self) -> float:
        return max(self.perturbed, self.restored)


def probe(vocab: int, length: int, seed: int = 0) -> list[int]:
    """``length`` token ids drawn from ``vocab`` with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def perturbed(weights: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """A copy of ``weights`` with every floating tensor moved by ``NOISE`` times its mean magnitude in random
    directions (norm gains, biases and routers too): an update that misses any of them shows in the log-probs."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        if not t.is_floating_point():
            out[name] = t.clone()
            continue
        scale = float(t.float().abs().mean()) or 1.0
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32) * (NOISE * scale)
        out[name] = (t.float() + noise).to(t.dtype)
    return out


def reference_model(model_dir: str | Path, model_type: str) -> torch.nn.Module:
    """The trainer's model code for ``model_dir`` in float32 on the CPU: the native model of a native family, else
    transformers' (``engines.model.hf.backend``)."""
    from engines.model.native.arch import FAMILIES

    if model_type in FAMILIES:
        from engines.model.io.hf_io import load_pretrained

        return load_pretrained(model_dir).eval()
    from engines.model.hf.backend import load_hf_model

    return load_hf_model(model_dir).eval()


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Each probe token's log-prob given those before it (float64 [len(ids) − 1]) under ``model`` holding
    ``weights`` (checkpoint names, written through the model's placements as the trainer's start-up read does)."""
    from engines.model.layout import hub_view, model_tensors, placements
    from engines.model.native.document_mask import DocumentMask

    own = model_tensors(model)
    for name, p in placements(model).items():
        hub_view(own[p.target], p).copy_(weights[name])
    tokens = torch.tensor([ids])
    targets = torch.cat([tokens[:, 1:], torch.full((1, 1), -1)], dim=1)
    mask = DocumentMask.from_padded(torch.ones_like(tokens, dtype=torch.bool))
    logprobs, _ = model(tokens, torch.arange(len(ids))[None], mask, targets=targets)
    return logprobs.double()


def vllm_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """The replica's log-prob of each probe token after the first (float64)."""
    return torch.tensor([s.logprob for s in engine.prompt_logprobs(ids)[1:]], dtype=torch.float64)


def served_by_vllm(engine, model_type: str, architecture: str) -> None:
    """Score the probe once: a model vLLM builds but cannot run (a kernel its platform lacks) fails here, in one
    line (``ReplicaCheckError``), instead of at the run's first rollout."""
    ids = probe(engine.vocab_size, min(PROBE_TOKENS, engine.max_seq_len - 1))
    try:
        vllm_logprobs(engine, ids)
    except Exception as e:
        raise ReplicaCheckError(f"vLLM on {engine.device.type} cannot run {model_type} ({architecture}): "
                                f"{type(e).__name__}: {_first_line(e)}") from e


def check_updates(engine, model_dir: str | Path, model_type: str) -> UpdateCheck:
    """Two in-place updates of ``engine`` (a ``VllmEngine`` keeping a host copy), to a perturbed copy of its weights
    and back, each scored against the trainer's model code (see the module); ``ReplicaCheckError`` in one line when
    vLLM drifts from the trainer (returns what was measured otherwise)."""
    ids = probe(engine.vocab_size, min(PROBE_TOKENS, engine.max_seq_len - 1))
    start = {n: t.clone() for n, t in engine.served_weights().items()}
    moved = perturbed(start)
    fresh = vllm_logprobs(engine, ids)
    engine.load_weights(iter(moved.items()))
    after_moved = vllm_logprobs(engine, ids)
    engine.load_weights(iter(start.items()))
    after_back = vllm_logprobs(engine, ids)
    reference = reference_model(model_dir, model_type)
    on_moved = reference_logprobs(reference, moved, ids)
    on_start = reference_logprobs(reference, start, ids)
    del reference
    found = UpdateCheck(fresh=_gap(fresh, on_start), perturbed=_gap(after_moved, on_moved),
                        restored=_gap(after_back, on_start), shift=_gap(after_moved, fresh), tokens=len(ids) - 1)
    allowed = max(TOLERANCE, 2 * found.fresh)
    if found.worst > allowed:
        raise ReplicaCheckError(
            f"vLLM on {engine.device.type} does not apply in-place weight updates to {model_type} exactly: after an "
            f"update its log-probs differ from the trainer's by {found.worst:.3g} (max over {found.tokens} probe "
            f"tokens; a fresh load {found.fresh:.2g}, allowed {allowed:.2g}), so it would sample from other weights "
            "than it is trained on; use GPU workers, or rollout.engine: native for a native family")
    return found


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"
