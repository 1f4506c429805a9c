"""The training engine: recomputes log-probabilities with gradients and steps the optimizers.

It owns the trainable model (plain, or sharded with ``engines.distributed.shard_model``) and its
optimizers; the RL algorithm (``rl.algorithm``) decides what loss to build from the
log-probabilities it returns. Between training phases ``offload`` moves the weights and optimizer
state to host memory so the colocated inference engine can use the accelerator.

With a sharded model every forward and backward is collective: all ranks must run the same number
of them, padding with ``dummy_forward``/``dummy_backward``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engines.distributed import is_sharded, local_shards, local_tensor, world_size
from engines.model import CausalLM, padded_causal_mask, positions_from_valid
from engines.offload import HostOffloader
from engines.sampling import token_logprobs


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int):
    """Right-pad prompt+response pairs: (ids [B, T], valid [B, T], target mask [B, T-1]).

    ``target[b, t]`` is True where token t+1 of row b is a response token, i.e. where the
    logits at t predict a response token.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    b, width = len(lengths), max(lengths)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    target = torch.zeros(b, width - 1, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, : lengths[i]] = torch.tensor(list(p) + list(r))
        valid[i, : lengths[i]] = True
        target[i, len(p) - 1 : lengths[i] - 1] = True
    return ids, valid, target


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient: the optimizer step was not taken (the weights are as before it)."""


def check_finite_grad_norm(norm: float, engine: TrainingEngine) -> None:
    """Refuse an optimizer step whose gradient norm is NaN or infinite (every rank sees the same global norm)."""
    if not math.isfinite(norm):
        engine.model.zero_grad(set_to_none=True)
        raise NonFiniteError(f"the gradient norm is {norm} in an optimizer step (a non-finite loss: a reward, "
                             "advantage or logit went NaN or infinite); the step was skipped and the run stopped")


class TrainingEngine:
    """Model plus optimizers, with log-probability recompute, a clipped optimizer step and offload."""

    def __init__(self, model: CausalLM, optimizers: list[torch.optim.Optimizer], pad_id: int,
                 max_grad_norm: float = 1.0) -> None:
        self.model = model.train()
        self.optimizers = optimizers
        self.pad_id = pad_id
        self.max_grad_norm = max_grad_norm
        self.device = local_tensor(next(model.parameters())).device
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

    def _forward(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        ids, valid = ids.to(self.device), valid.to(self.device)
        return self.model(ids, positions_from_valid(valid), padded_causal_mask(valid))

    def response_logprobs(self, prompts, responses,
                          temperature: float | Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of the response tokens [B, T-1] (zero elsewhere) and their mask.

        ``temperature`` is one for all rows or one per row (0 = greedy, scored at T = 1).
        Differentiable; the caller decides whether to wrap it in ``torch.no_grad``.
        """
        self._check_onloaded()
        ids, valid, target = pack(prompts, responses, self.pad_id)
        logits = self._forward(ids, valid)[:, :-1]
        if isinstance(temperature, numbers.Real) or (isinstance(temperature, torch.Tensor) and temperature.ndim == 0):
            temps: float | torch.Tensor = float(temperature)
        else:
            temps = torch.as_tensor([float(t) for t in temperature], dtype=torch.float32, device=logits.device)
            if temps.shape != (len(prompts),):
                raise ValueError(f"{temps.numel()} temperatures for {len(prompts)} rows")
        logp = token_logprobs(logits, temps)
        target = target.to(self.device)
        lp = logp.gather(-1, ids.to(self.device)[:, 1:, None]).squeeze(-1)
        return lp * target, target

    def _dummy_ids(self) -> torch.Tensor:
        return torch.full((1, 2), self.pad_id if self.pad_id is not None else 0)

    def dummy_forward(self) -> None:
        """A no-grad forward on two tokens: pads a rank's no-grad forwards to its peers' count."""
        self._check_onloaded()
        if not self.sharded:
            return  # no collectives to keep in step with
        with torch.no_grad():
            self._forward(self._dummy_ids(), torch.ones(1, 2, dtype=torch.bool))

    def dummy_backward(self) -> None:
        """A forward/backward on two tokens that adds exactly zero to every gradient.

        Pads a rank with fewer micro-batches so every rank runs FSDP's collectives equally often.
        A plain model has no collectives, so there it does nothing (gradients that are None stay None).
        """
        self._check_onloaded()
        if not self.sharded:
            return
        logits = self._forward(self._dummy_ids(), torch.ones(1, 2, dtype=torch.bool))
        (logits.float().sum() * 0.0).backward()

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
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
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
        its byte offset in the full tensor (as ``engines.distributed.local_shards``)."""
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
