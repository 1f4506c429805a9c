"""The training engine: recomputes log-probabilities with gradients and steps the optimizers.

It owns the trainable model (plain, or sharded with ``engines.training.distributed.shard_model``) and its
optimizers; the RL algorithm (``rl.algorithm``) decides what loss to build from the
log-probabilities it returns. Sequences are packed end to end with document masking
(``engines.training.packing``), and only the response tokens' log-probabilities are scored, in vocabulary
chunks (``engines.model.logprobs``). Between training phases ``offload`` moves the weights and optimizer
state to host memory so the colocated inference engine can use the accelerator.

With a sharded model every forward and backward is collective: all ranks must run the same number
of them, padding with ``dummy_forward``/``dummy_backward``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engines.model.causal_lm import CausalLM
from engines.model.document_mask import DocumentMask
from engines.model.sharded import local_shards, local_tensor
from engines.training.distributed import all_reduce_sum, is_sharded, world_size
from engines.training.offload import HostOffloader
from engines.training.packing import PackedBatch, pack

ATTENTION_BACKENDS = ("auto", "sdpa", "flex")


@dataclass
class TokenScores:
    """Per response token, laid out [sequences, longest response] (zero past each response)."""

    logprobs: torch.Tensor   # float32, differentiable
    mask: torch.Tensor       # bool: a response token
    entropy: torch.Tensor    # float32, no gradient: entropy of the distribution the token was scored under
    tokens: int              # tokens of the packed micro-batch (prompts included)


def inverse_temperatures(temperature: float | Sequence[float] | torch.Tensor, n: int) -> list[float]:
    """1/T per sequence (greedy, T = 0, is scored at T = 1) from one temperature or one per sequence."""
    if isinstance(temperature, numbers.Real) or (isinstance(temperature, torch.Tensor) and temperature.ndim == 0):
        temps = [float(temperature)] * n
    else:
        temps = [float(t) for t in temperature]
        if len(temps) != n:
            raise ValueError(f"{len(temps)} temperatures for {n} rows")
    return [1.0 / t if t > 0 else 1.0 for t in temps]


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient: the optimizer step was not taken (the weights are as before it)."""


def check_finite_grad_norm(norm: float, engine: TrainingEngine) -> None:
    """Refuse an optimizer step whose gradient norm is NaN or infinite (every rank sees the same global norm)."""
    if not math.isfinite(norm):
        engine.model.zero_grad(set_to_none=True)
        raise NonFiniteError(f"the gradient norm is {norm} in an optimizer step (a non-finite loss: a reward, "
                             "advantage or logit went NaN or infinite); the step was skipped and the run stopped")


class TrainingEngine:
    """Model plus optimizers, with log-probability recompute, a clipped optimizer step and offload.

    ``attention``: "sdpa" (a dense document mask; the CPU path), "flex" (flex_attention block masks; the
    GPU path) or "auto" (flex on CUDA, sdpa elsewhere). After every ``step`` ``update_rms`` holds the root
    mean square of the weight change per optimizer ("muon", "adamw"), over all ranks.
    """

    def __init__(self, model: CausalLM, optimizers: list[torch.optim.Optimizer], pad_id: int,
                 max_grad_norm: float = 1.0, attention: str = "auto") -> None:
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
        self.model = model.train()
        self.optimizers = optimizers
        self.pad_id = pad_id if pad_id is not None else 0
        self.max_grad_norm = max_grad_norm
        self.device = local_tensor(next(model.parameters())).device
        if attention == "auto":
            attention = "flex" if self.device.type == "cuda" else "sdpa"
        self.attention = attention
        self.update_rms: dict[str, float] = {}
        self._offloader = HostOffloader()
        self._host_shards: dict[str, tuple[torch.Tensor, int]] = {}

    @property
    def sharded(self) -> bool:
        return is_sharded(self.model)

    @property
    def offloaded(self) -> bool:
        return self._offloader.offloaded

    def _check_onloaded(self) -> None:
        if self.offloaded:
            raise RuntimeError("the training engine is offloaded: call onload() first")

    def _run(self, batch: PackedBatch, inv_temp: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-prob, entropy) of every target of ``batch`` (on this engine's device)."""
        return self.model(batch.ids, batch.positions, batch.mask, targets=batch.targets, inv_temp=inv_temp)

    def score(self, prompts, responses, temperature: float | Sequence[float]) -> TokenScores:
        """Log-probabilities (differentiable) and entropies of the response tokens, packed into one pass.

        ``temperature`` is one for all rows or one per row (0 = greedy, scored at T = 1).
        """
        self._check_onloaded()
        batch = pack(prompts, responses, self.pad_id, self.attention).to(self.device)
        inv = torch.tensor(inverse_temperatures(temperature, len(prompts)), dtype=torch.float32, device=self.device)
        lp, ent = self._run(batch, inv[batch.target_seq])
        return TokenScores(batch.per_sequence(lp), batch.response_mask(), batch.per_sequence(ent), batch.tokens)

    def response_logprobs(self, prompts, responses,
                          temperature: float | Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of the response tokens [B, longest response] (zero elsewhere) and their mask.

        Differentiable; the caller decides whether to wrap it in ``torch.no_grad``.
        """
        s = self.score(prompts, responses, temperature)
        return s.logprobs, s.mask

    def _dummy(self) -> PackedBatch:
        """Two filler tokens: no document, so no query of the max-logit statistic; one target to backward through."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long)
        mask = DocumentMask(torch.full((1, 2), -1), torch.zeros(1, 2, dtype=torch.long), self.attention)
        targets = torch.tensor([[self.pad_id, -1]])
        return PackedBatch(ids, mask, targets, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), [1])

    def dummy_forward(self) -> None:
        """A no-grad forward on two filler tokens: pads a rank's no-grad forwards to its peers' count."""
        self._check_onloaded()
        if not self.sharded:
            return  # no collectives to keep in step with
        with torch.no_grad():
            self._run(self._dummy().to(self.device), 1.0)

    def dummy_backward(self) -> None:
        """A forward/backward on two filler tokens that adds exactly zero to every gradient and nothing to the
        tracked max logits.

        Pads a rank with fewer micro-batches so every rank runs FSDP's collectives equally often.
        A plain model has no collectives, so there it does nothing (gradients that are None stay None).
        """
        self._check_onloaded()
        if not self.sharded:
            return
        lp, _ = self._run(self._dummy().to(self.device), 1.0)
        (lp.sum() * 0.0).backward()

    def step(self) -> float:
        """Clip gradients, step every optimizer, zero gradients; returns the global pre-clip grad norm.

        With a sharded model the norm is over all ranks' shards (a collective).
        """
        self._check_onloaded()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        check_finite_grad_norm(float(norm), self)
        sums: list[float] = []
        for opt in self.optimizers:
            sums += _step_measured(opt)
            opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        totals = all_reduce_sum(sums)
        self.update_rms = {}
        for i, opt in enumerate(self.optimizers):
            sq, n = totals[2 * i], totals[2 * i + 1]
            if n:
                self.update_rms[_kind(opt)] = (sq / n) ** 0.5
        return float(norm)

    # ---- offload / onload -------------------------------------------------------------------

    def _state_tensors(self) -> list[torch.Tensor]:
        """Every tensor whose storage offload moves: parameters, buffers, optimizer state on our device."""
        out = [local_tensor(p) for p in self.model.parameters()] + [local_tensor(b) for b in self.model.buffers()]
        for opt in self.optimizers:
            for state in opt.state.values():
                out.extend(local_tensor(v) for v in state.values() if isinstance(v, torch.Tensor))
        # optimizers keep scalars such as AdamW's ``step`` on the CPU even for CUDA parameters
        return [t for t in out if t.device == self.device]

    def offload(self) -> dict:
        """Move parameters and optimizer state to one host buffer and drop gradients.

        Returns {"bytes", "seconds"}. Raises RuntimeError when already offloaded. Until ``onload``
        the model can not run; ``host_shards`` gives the parameters' bytes meanwhile.
        """
        self._check_onloaded()
        if self.sharded:
            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()  # a no-grad forward of the root leaves its parameters gathered
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        shards = local_shards(self.model)
        stats = self._offloader.offload(self._state_tensors(), expose={n: t for n, (t, _) in shards.items()})
        self._host_shards = {n: (self._offloader.views[n], off) for n, (_, off) in shards.items()}
        return stats

    def onload(self) -> dict:
        """Bring parameters and optimizer state back (one host-to-device pass); returns {"bytes", "seconds"}.

        Raises RuntimeError when not offloaded.
        """
        stats = self._offloader.onload()
        self._host_shards = {}
        return stats

    def host_shards(self) -> dict[str, tuple[torch.Tensor, int]]:
        """While offloaded: per state_dict name, this rank's shard as a view of the host buffer and
        its byte offset in the full tensor (as ``engines.model.sharded.local_shards``)."""
        if not self.offloaded:
            raise RuntimeError("host_shards() is only valid while offloaded; use local_shards(model) otherwise")
        return dict(self._host_shards)

    # ---- optimizer state --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's optimizer states (weights are saved separately, in Hugging Face format).

        Sharded states are stored as this rank's local tensors: resuming needs the same world size.
        """
        self._check_onloaded()
        opts = []
        for opt in self.optimizers:
            sd = opt.state_dict()
            sd["state"] = {k: {n: local_tensor(v) if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                           for k, s in sd["state"].items()}
            opts.append(sd)
        return {"optimizers": opts, "world_size": world_size()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (on every rank, from that rank's own file)."""
        self._check_onloaded()
        saved_world = state.get("world_size", 1)
        if saved_world != world_size():
            raise ValueError(f"optimizer state saved with world size {saved_world}, now {world_size()}")
        for opt, s in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(s)
            for p, st in opt.state.items():
                if not isinstance(p, DTensor):
                    continue
                for name, v in st.items():
                    if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.ndim > 0:
                        if v.shape != p.to_local().shape:
                            raise ValueError(f"optimizer state {name} has local shape {tuple(v.shape)}, the "
                                             f"parameter's shard {tuple(p.to_local().shape)}")
                        st[name] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                                      shape=p.shape, stride=p.stride())


def _kind(opt: torch.optim.Optimizer) -> str:
    return "muon" if isinstance(opt, torch.optim.Muon) else type(opt).__name__.lower()


def _step_measured(opt: torch.optim.Optimizer) -> list[float]:
    """Step ``opt``; returns [Σ (Δw)², elements] over this rank's shards of the parameters it moved.

    An optimizer that measures its own step (``last_update_sq``, ``last_update_numel``: ShardedMuon) is
    trusted; for others the stepped parameters' local shards are copied first.
    """
    if hasattr(opt, "last_update_sq"):
        opt.step()
        return [float(opt.last_update_sq), float(opt.last_update_numel)]
    params = [local_tensor(p) for g in opt.param_groups for p in g["params"] if p.grad is not None]
    before = [p.detach().clone() for p in params]
    opt.step()
    sq = sum(float((p.detach().float() - b.float()).square().sum()) for p, b in zip(params, before, strict=True))
    return [sq, float(sum(p.numel() for p in params))]
