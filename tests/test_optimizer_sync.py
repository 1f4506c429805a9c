"""How often the optimizer step makes the host wait for the device, checked on a CPU.

On a GPU every host read of a device value (``.item()``, ``float(t)``, ``.tolist()``, a copy to the host) stalls
the host until the device has run everything queued. The budget: Muon's step reads nothing, the training
engine's step reads the device once (the gradient norm, which must refuse a non-finite step before any weight
moves, with everything else riding along), and an update of S optimizer steps reads it S + 1 times (each step's
metrics complete at the next step's read; the last step's in one more). ``tests.sync_check`` sees the ops at
the dispatcher; a CPU run counts them as a GPU run would meet them.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engines.model.native.causal_lm import track_max_logits
from engines.training.engine import NonFiniteError, TrainingEngine
from engines.training.muon import ShardedMuon
from engines.training.optim import build_optimizers
from engines.training.packing import pack
from rl.algo import update
from rl.algo.batches import plan_update
from rl.algo.objectives import Objective
from rl.algo.update import rl_update
from rl.settings import UpdateSettings
from tests.conftest import make_sample, sharp_model, tiny_config
from tests.sync_check import HostSyncChecker, unwatched

VOCAB = 37


class _HostCopies(TorchFunctionMode):
    """``.cpu()``/``.numpy()`` of a compute-device tensor: a no-op on a CPU run, so the dispatcher never sees it."""

    def __init__(self, checker: StepChecker) -> None:
        super().__init__()
        self.checker = checker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.cpu, torch.Tensor.numpy) and self.checker.is_compute(args[0].device):
            self.checker.report(f"Tensor.{func.__name__}", "copies device values to the host")
        return func(*args, **(kwargs or {}))


class StepChecker(HostSyncChecker):
    """``HostSyncChecker`` on a CPU run that plays the accelerator, less the optimizers' ``step`` counters: torch
    keeps those on the host even for GPU parameters (not capturable), so reading them never waits for a device."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        super().__init__(compute_device="cpu")
        self.host_scalars = [s["step"] for opt in optimizers for s in opt.state.values()
                             if isinstance(s.get("step"), torch.Tensor)]

    def on_compute(self, args: tuple) -> bool:
        tensors = [t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        if tensors and all(any(t is s for s in self.host_scalars) for t in tensors):
            return False
        return super().on_compute(args)

    def __enter__(self) -> StepChecker:
        super().__enter__()
        self._copies = _HostCopies(self)
        self._copies.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._copies.__exit__(*exc)
        super().__exit__(*exc)


def _engine(qk_tau: float | None = None) -> TrainingEngine:
    model = sharp_model(tiny_config(VOCAB), 0)
    track_max_logits(model)
    return TrainingEngine(model, build_optimizers(model, "muon", 1e-2, 0.1), 0, max_grad_norm=0.05, attention="sdpa",
                          qk_clip=True, qk_clip_tau=qk_tau)


def _backward(engine: TrainingEngine, seed: int) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 6))] for _ in range(4)]
    responses = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 5))] for _ in range(4)]
    lp, _ = engine.response_logprobs(prompts, responses, 1.0)
    (-lp.sum()).backward()


def test_the_checker_sees_reads_of_the_device_but_not_of_host_step_counters():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(3)
    opt.step()  # the state, with its host ``step`` counter, exists from here on
    with StepChecker([opt]) as c:
        p.grad = torch.ones(3)
        opt.step()  # reads its step counter on the host
    assert c.found == []
    with StepChecker([opt]) as c:
        p.sum().item()
        p.detach().cpu()
        p.tolist()
    assert [f.op for f in c.found] == ["aten._local_scalar_dense.default", "Tensor.cpu", "Tensor.tolist"]


def test_muon_step_reads_nothing_back():
    """Its update-RMS sum stays on the device for the caller to read with the step's other values."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in [(8, 6), (8, 6), (6, 10), (3, 4, 5)]]
    opt = ShardedMuon(params, lr=0.05, weight_decay=0.1)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        with StepChecker([opt]) as c:
            opt.step()
        assert c.found == [], f"step {step}: {c.found}"
    assert isinstance(opt.last_update_sq, torch.Tensor) and opt.last_update_sq > 0


@pytest.mark.parametrize("tau", [None, 1e-3])  # 1e-3: every tracked head is clipped
def test_training_engine_step_reads_the_device_once(tau):
    """Clipping, both optimizers and QK-Clip: one read, the gradient norm's, which brings the maxima along."""
    engine = _engine(tau)
    _backward(engine, 0)
    engine.step()  # the optimizers' state (AdamW's host step counter among it) exists from here on
    _backward(engine, 1)
    before = [p.detach().clone() for p in engine.model.parameters()]
    with StepChecker(engine.optimizers) as c:
        norm = engine.step()
    assert len(c.found) <= 1, c.found
    assert norm > 0.05  # clipping acted
    moved = [not torch.equal(b, p) for b, p in zip(before, engine.model.parameters(), strict=True)]
    assert all(moved)
    metrics = engine.last_step  # not read yet: this reads the update sums
    assert set(engine.update_rms) == {"muon", "adamw"} and all(v > 0 for v in engine.update_rms.values())
    assert metrics["max_logit"] > 0 and (metrics["qk_clipped_heads"] > 0) == (tau is not None)


def test_rl_update_reads_the_device_once_per_step_and_once_more(monkeypatch):
    """The losses, the norm, the maxima and the last step's update RMS share each step's read. Packing is left
    unwatched: it works on host data, before the upload, which a CPU run cannot tell from the device's."""

    def host_pack(*args, **kwargs):
        with unwatched():
            return pack(*args, **kwargs)

    monkeypatch.setattr(update, "pack", host_pack)
    rng = random.Random(3)
    samples = []
    for group in range(4):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 5))]
        for reward in (0.0, 1.0):
            response = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 4))]
            samples.append(make_sample(group, prompt, response, [-1.0] * len(response), reward))
    s = UpdateSettings(objective=Objective("k15", tau=1.0), minibatches=2, micro_batch_tokens=4096, micro_batch=None,
                       drop_equal_groups=True, recompute_old=False, correction=None, ptx_coef=0.0)
    engine = _engine(10.0)
    (batch,) = plan_update(samples, s, 1, seed=0)
    warm = list(rl_update(engine, batch, s))  # creates the optimizers' state
    assert len(warm) == 2
    with StepChecker(engine.optimizers) as c:
        steps = list(rl_update(engine, batch, s))
    assert len(c.found) <= len(steps) + 1, c.found
    for step in steps:
        assert {"loss", "grad_norm", "update_rms/muon", "update_rms/adamw", "max_logit"} <= set(step)


def test_a_non_finite_step_still_reports_the_steps_before_it(monkeypatch):
    """Metrics lag one read behind their step: a refused step yields the completed step's first, then raises."""
    samples = [make_sample(g, [2 + g, 3, 4], [5, 6 + r], [-1.0, -1.0], float(r)) for g in range(4) for r in (0, 1)]
    s = UpdateSettings(objective=Objective("k15", tau=1.0), minibatches=2, micro_batch_tokens=4096, micro_batch=None,
                       drop_equal_groups=True, recompute_old=False, correction=None, ptx_coef=0.0)
    engine = _engine(None)
    clip = torch.nn.utils.clip_grad_norm_
    calls = []

    def nan_on_the_second_step(params, max_norm):
        calls.append(clip(params, max_norm))
        return calls[-1] * float("nan") if len(calls) == 2 else calls[-1]

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_on_the_second_step)
    (batch,) = plan_update(samples, s, 1, seed=0)
    out = rl_update(engine, batch, s)
    first = next(out)  # yielded on the way out of the refused second step
    with pytest.raises(NonFiniteError):
        next(out)
    assert first["grad_norm"] > 0 and first["update_rms/muon"] > 0 and first["update_rms/adamw"] > 0
