"""The training engine: recomputes log-probabilities with gradients and steps the optimizers.

It owns the trainable model (plain, or sharded with ``engines.training.distributed.shard_model``) and its
optimizers; the RL algorithm (``rl.algo.update``) decides what loss to build from the
log-probabilities it returns. Sequences are packed end to end with document masking
(``engines.training.packing``), and only the response tokens' log-probabilities are scored, in vocabulary
chunks (``engines.model.logprobs``). Between training phases ``offload`` moves the weights and optimizer
state to host memory so the colocated inference engine can use the accelerator.

With a sharded model every forward and backward is collective: all ranks must run the same number
of them, padding with ``dummy_forward``/``dummy_backward``.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from engines.device import to_device
from engines.model.native.arch import ModelConfig
from engines.model.native.attention import FLEX_COMPILED_DEVICES, FLEX_FALLBACK, attention_dims, why_not_flex
from engines.model.native.causal_lm import CausalLM
from engines.model.native.compile import use_compile_cache
from engines.model.native.document_mask import DocumentMask
from engines.model.sharded import local_shards, local_tensor
from engines.training import expert_parallel
from engines.training.distributed import all_reduce_tensor, is_sharded, keeps_gathered, reshard_all, world_size
from engines.training.offload import HostOffloader
from engines.training.packing import PackedBatch, flex_row_width, pack
from engines.training.qk_clip import check_tau, clip_from_maxima, max_logit_table
from engines.training.readback import Deferred, HostReads
from engines.training.timing import Mark, StepTiming

if TYPE_CHECKING:
    from engines.model.hf.vision import PackedMedia
    from engines.model.text.processor import VisionProcessor

ATTENTION_BACKENDS = ("auto", "sdpa", "flex")

log = logging.getLogger(__name__)
_noticed: set[str] = set()


def resolve_attention(requested: str, device_type: str, cfg: ModelConfig) -> str:
    """The training attention backend for ``requested`` on ``device_type``: "auto" is flex where flex compiles
    (CUDA) and the model's head dimensions fit its kernel, else sdpa (with a one-time notice on CUDA)."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    if requested == "sdpa":
        return "sdpa"
    compiled = device_type in FLEX_COMPILED_DEVICES
    why = why_not_flex(*attention_dims(cfg)) if compiled else None
    if requested == "flex":
        if why is not None:
            raise ValueError(f"attention 'flex' on {device_type}: {why}; use 'auto' or 'sdpa'")
        return "flex"
    if not compiled:
        return "sdpa"
    if why is not None:
        if why not in _noticed:
            _noticed.add(why)
            log.warning("training attention: sdpa (attention: auto; %s)", why)
        return "sdpa"
    return "flex"


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


@dataclass
class StepMetrics:
    """One optimizer step's metrics: per optimizer the update RMS, whose sums stay on the device until the next host
    read (or until asked for), QK-Clip's, on the host already, and the step's timing (``engines.training.timing``:
    on CUDA events that the same read lets the host measure without a wait of their own)."""

    kinds: list[str] = field(default_factory=list)  # ``_kind`` of each optimizer
    totals: Deferred | None = None                  # [Σ (Δw)², elements] per optimizer, summed over ranks
    qk_clip: dict[str, float] = field(default_factory=dict)
    timing: StepTiming | None = None

    def update_rms(self) -> dict[str, float]:
        """Root mean square of the weight change per optimizer kind that moved any weight."""
        v = self.totals.values if self.totals is not None else []
        return {kind: (v[2 * i] / v[2 * i + 1]) ** 0.5 for i, kind in enumerate(self.kinds) if v[2 * i + 1]}

    def seconds(self) -> dict[str, float]:
        """This rank's ``fwd_bwd_s`` (from the step's first differentiable forward to its start) and ``optimizer_s``
        (the step: clipping, the optimizers, QK-Clip); read after the update sums, whose read they ride on."""
        if self.timing is None:
            return {}
        if self.totals is not None:
            self.totals.values  # noqa: B018 -- the queued read that the step's events finished before
        return self.timing.seconds()

    def as_dict(self) -> dict[str, float]:
        """``update_rms/<kind>``, the QK-Clip metrics and the step's ``train_fwd_bwd_s``/``train_optimizer_s``."""
        return {**{f"update_rms/{k}": v for k, v in self.update_rms().items()}, **self.qk_clip,
                **{f"train_{k}": v for k, v in self.seconds().items()}}


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
    GPU path) or "auto" (``resolve_attention``: flex on CUDA when the head dimensions fit its kernel, sdpa
    otherwise). After every ``step`` ``update_rms`` holds the root mean square of the weight change per
    optimizer ("muon", "adamw"), over all ranks. With ``qk_clip`` the step ends with QK-Clip
    (``engines.training.qk_clip``: heads whose max logit exceeded ``qk_clip_tau`` rescaled; None only reports the
    maxima); ``last_step`` holds the step's update RMS and QK-Clip metrics.

    A step waits for the device once, to read the gradient norm; ``reads`` queues other device values to read in
    that same copy (a caller's losses), and the step's update RMS waits on the device for the next such read
    (``step_metrics``), or is read on its own when ``update_rms``/``last_step`` ask first. ``step_metrics`` also
    times the step: forward and backward (from the first differentiable forward after the previous step) apart
    from the optimizer step, with CUDA events on a GPU (no wait of their own).
    """

    def __init__(self, model: CausalLM, optimizers: list[torch.optim.Optimizer], pad_id: int,
                 max_grad_norm: float = 1.0, attention: str = "auto", qk_clip: bool = False,
                 qk_clip_tau: float | None = None) -> None:
        self.model = model.train()
        self.optimizers = optimizers
        self.pad_id = pad_id if pad_id is not None else 0
        self.max_grad_norm = max_grad_norm
        self.device = local_tensor(next(model.parameters())).device
        self.attention = resolve_attention(attention, self.device.type, model.config)
        if self.attention == "flex" and self.device.type in FLEX_COMPILED_DEVICES:
            use_compile_cache()  # flex_attention's compiled kernels, kept for the next process as compiled layers
        self.qk_clip, self.qk_clip_tau = qk_clip, qk_clip_tau
        self.reads = HostReads()
        self.step_metrics = StepMetrics()
        self._offloader = HostOffloader()
        self._host_shards: dict[str, tuple[torch.Tensor, int]] = {}
        self._forward_mark: Mark | None = None  # the first differentiable forward since the last step
        # one rank under mixed precision: a forward leaves the layers gathered (distributed.shard_model)
        self._keeps_gathered = keeps_gathered(model)
        self._expert_parallel = expert_parallel.is_expert_parallel(model)
        #: a vision-language model's processor, which expands each sample's image placeholders (set by the caller)
        self.processor: VisionProcessor | None = None

    @property
    def sharded(self) -> bool:
        return is_sharded(self.model)

    @property
    def update_rms(self) -> dict[str, float]:
        """The last step's root mean square weight change per optimizer kind (reads the device if not yet read)."""
        return self.step_metrics.update_rms()

    @property
    def last_step(self) -> dict[str, float]:
        """The last step's update RMS and QK-Clip metrics (reads the device if not yet read)."""
        return self.step_metrics.as_dict()

    @property
    def offloaded(self) -> bool:
        return self._offloader.offloaded

    @property
    def attention_fallback(self) -> int:
        """1 once compiled flex_attention failed in this process and the dense path took over (a metric), else 0."""
        return int(self.attention == "flex" and FLEX_FALLBACK.reason is not None)

    def _check_onloaded(self) -> None:
        if self.offloaded:
            raise RuntimeError("the training engine is offloaded: call onload() first")

    def _run(self, batch: PackedBatch, inv_temp: torch.Tensor | float,
             media: PackedMedia | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-prob, entropy) of every target of ``batch`` (on this engine's device); ``media``: its images."""
        grad = torch.is_grad_enabled()
        if grad and self._forward_mark is None:
            self.mark_forward()
        # select: the targets' flat positions, so the forward needs no boolean mask (a host sync)
        out = self.model(batch.ids, batch.positions, batch.mask, select=batch.target_flat, targets=batch.targets,
                         inv_temp=inv_temp, **({"media": media} if media is not None else {}))
        if not grad and self._keeps_gathered:  # no backward will free the gathered copies: free them now
            reshard_all(self.model)
        return out

    def mark_forward(self) -> None:
        """Start timing the step's forward and backward here (``score`` does it at the step's first differentiable
        forward; a caller that runs the model itself calls it first)."""
        self._forward_mark = Mark(self.device)

    def score(self, prompts, responses, temperature: float | Sequence[float]) -> TokenScores:
        """Log-probabilities (differentiable) and entropies of the response tokens, packed into one pass.

        ``temperature`` is one for all rows or one per row (0 = greedy, scored at T = 1).
        """
        self._check_onloaded()
        host = pack(prompts, responses, self.pad_id, self.attention)
        inv = torch.tensor(inverse_temperatures(temperature, len(prompts)), dtype=torch.float32)[host.target_seq]
        return self.score_packed(host, inv)

    def score_packed(self, host: PackedBatch, inv_temp: torch.Tensor, media: PackedMedia | None = None) -> TokenScores:
        """``score`` of a batch ``pack`` made on the host, with 1/T per target (host) and its images (``media``,
        a vision-language model's): the device part, which uploads without blocking and never waits for the
        device."""
        batch = host.to(self.device)
        lp, ent = self._run(batch, to_device(inv_temp, self.device), media)
        return TokenScores(batch.per_sequence(lp), batch.response_mask(), batch.per_sequence(ent), batch.tokens)

    def response_logprobs(self, prompts, responses,
                          temperature: float | Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of the response tokens [B, longest response] (zero elsewhere) and their mask.

        Differentiable; the caller decides whether to wrap it in ``torch.no_grad``.
        """
        s = self.score(prompts, responses, temperature)
        return s.logprobs, s.mask

    def _dummy(self) -> PackedBatch:
        """Filler tokens only: no document, so no query of the max-logit statistic; one target to backward through.
        Two of them, or on flex a row of the width packing gives (no shape of its own for the compiled kernel)."""
        w = flex_row_width(2) if self.attention == "flex" else 2
        ids = torch.full((1, w), self.pad_id, dtype=torch.long)
        mask = DocumentMask(doc=torch.full((1, w), -1), positions=torch.zeros(1, w, dtype=torch.long),
                            backend=self.attention)
        targets = torch.full((1, w), -1, dtype=torch.long)
        targets[0, 0] = self.pad_id
        zero = torch.zeros(1, dtype=torch.long)
        return PackedBatch(ids=ids, mask=mask, targets=targets, target_seq=zero, target_index=zero,
                           response_lengths=[1], target_flat=zero, tokens=0)

    def dummy_forward(self) -> None:
        """A no-grad forward on filler tokens (``_dummy``): pads a rank's no-grad forwards to its peers' count."""
        self._check_onloaded()
        if not self.sharded:
            return  # no collectives to keep in step with
        with torch.no_grad():
            self._run(self._dummy().to(self.device), 1.0)

    def dummy_backward(self) -> None:
        """A forward/backward on filler tokens (``_dummy``) that adds exactly zero to every gradient and nothing to
        the tracked max logits.

        Pads a rank with fewer micro-batches so every rank runs FSDP's collectives equally often.
        A plain model has no collectives, so there it does nothing (gradients that are None stay None).
        """
        self._check_onloaded()
        if not self.sharded:
            return
        lp, _ = self._run(self._dummy().to(self.device), 1.0)
        (lp.sum() * 0.0).backward()

    def step(self) -> float:
        """Clip gradients, step every optimizer, zero gradients (and QK-Clip, with ``qk_clip``); returns the global
        pre-clip grad norm. With a sharded model the norm is over all ranks' shards (a collective).

        The host waits for the device once: the norm (a non-finite one refuses the step before any weight moves),
        QK-Clip's maxima and everything queued on ``reads`` come back in one copy.
        """
        self._check_onloaded()
        start, forward, self._forward_mark = Mark(self.device), self._forward_mark, None
        if self.qk_clip:
            check_tau(self.qk_clip_tau)
        if self._keeps_gathered:
            reshard_all(self.model)  # a forward without its backward left copies that the step would make stale
        params = [p for p in self.model.parameters() if p.grad is not None]
        # the clip factor is applied as a device tensor: clipping itself needs no host read
        if self._expert_parallel:  # two meshes: FSDP2's and the experts'
            norm = expert_parallel.clip_grad_norm(self.model, params, self.max_grad_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        read = self.reads.defer(norm)
        # the maxima were tracked by the forwards, so they ride along the norm's read rather than a read of their own
        table = max_logit_table(self.model) if self.qk_clip else None
        maxima = self.reads.defer(table) if table is not None else None
        grad_norm = read.values[0]  # the step's one wait for the device
        check_finite_grad_norm(grad_norm, self)
        sums: list[torch.Tensor] = []
        for opt in self.optimizers:
            sums += _step_measured(opt, self.device)
            opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        qk: dict[str, float] = {}
        if self.qk_clip:
            heads = table.size(1) if table is not None else 0
            rows = maxima.values if maxima is not None else []
            qk = clip_from_maxima(self.model, [rows[i:i + heads] for i in range(0, len(rows), heads)],
                                  self.qk_clip_tau)
        totals = self.reads.defer(all_reduce_tensor(torch.stack(sums), "sum")) if sums else None
        timing = StepTiming(forward, start, Mark(self.device))
        self.step_metrics = StepMetrics([_kind(opt) for opt in self.optimizers], totals, qk, timing)
        return grad_norm

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
            reshard_all(self.model)  # a no-grad forward of the root leaves its parameters gathered
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

    @contextmanager
    def onloaded(self) -> Iterator[None]:
        """The tensors in place for the duration (an offloaded tensor has no storage), offloaded again after."""
        was = self.offloaded
        if was:
            self.onload()
        try:
            yield
        finally:
            if was:
                self.offload()

    def weight_shards(self) -> dict[str, tuple[torch.Tensor, int]]:
        """This rank's shard of every weight and its byte offset in the full tensor, live or offloaded (then views
        of the host buffer: a weight update's stage 1 is the H2D copy)."""
        return self.host_shards() if self.offloaded else local_shards(self.model)

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


def _step_measured(opt: torch.optim.Optimizer, device: torch.device) -> list[torch.Tensor]:
    """Step ``opt``; returns [Σ (Δw)², elements] over this rank's shards of the parameters it moved, as float64
    tensors on ``device`` (not read: the caller reads them with other values).

    An optimizer that measures its own step (``last_update_sq``, ``last_update_numel``: ShardedMuon) is
    trusted; for others the stepped parameters' local shards are copied first.
    """
    if hasattr(opt, "last_update_sq"):
        opt.step()
        sq, numel = opt.last_update_sq, opt.last_update_numel
    else:
        params = [local_tensor(p) for g in opt.param_groups for p in g["params"] if p.grad is not None]
        before = [p.detach().clone() for p in params]
        opt.step()
        sq = torch.stack([(p.detach().float() - b.float()).square().sum()
                          for p, b in zip(params, before, strict=True)]).sum() if params else 0.0
        numel = sum(p.numel() for p in params)
    # a fill, not an upload of host data: no wait on the host
    return [sq.to(device, torch.float64) if isinstance(sq, torch.Tensor)
            else torch.full((), float(sq), dtype=torch.float64, device=device),
            torch.full((), float(numel), dtype=torch.float64, device=device)]
