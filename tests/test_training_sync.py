"""The training micro-step never makes the host wait for the device: log-probabilities scored in vocabulary
chunks, the packed forward, the loss and its backward, and the optimizer step's bookkeeping.

A ``TorchDispatchMode`` checker (``tests.sync_check``) sees every op a CPU run dispatches; an op whose
output size depends on the data (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``) or that
reads a value back (``.item()``, ``.tolist()``) would stall a GPU's queue just the same. Work ``pack`` does
on the host before uploading is outside what is checked.
"""

from __future__ import annotations

import random

import torch

from engines.model.logprobs import selected_logprobs
from engines.model.native.causal_lm import CausalLM, track_max_logits
from engines.training.engine import TrainingEngine, inverse_temperatures
from engines.training.packing import pack
from rl.algo.objectives import k15_loss
from rl.algo.update import rl_update
from tests.conftest import tiny_config
from tests.sync_check import HostSyncChecker, no_host_sync

VOCAB = 61
#: Ops that read device values back on the host.
READS = {"aten._local_scalar_dense.default", "Tensor.tolist", "aten.equal.default", "aten.is_nonzero.default"}


def _batch(n: int = 7, seed: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    responses = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(n)]
    return prompts, responses


def _model() -> CausalLM:
    """Sliding and full layers, activation checkpointing and max-logit tracking: every branch of the step."""
    torch.manual_seed(0)
    model = CausalLM(tiny_config(VOCAB, intermediate_size=40, model_type="qwen3", sliding_window=4,
                                 layer_types=["sliding_attention", "full_attention"]))
    model.activation_checkpointing = True
    track_max_logits(model)
    return model


def test_chunked_logprobs_forward_and_backward_are_sync_free():
    """Targets spread over several vocabulary chunks (one chunk at a time holds each); the chunked scoring once
    found each chunk's targets with ``nonzero`` (~74 host waits per 16 K-token micro-batch)."""
    torch.manual_seed(0)
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(VOCAB, 16, requires_grad=True)
    targets = torch.randint(0, VOCAB, (40,))
    inv = torch.rand(40) + 0.5
    with no_host_sync("cpu"):
        lp, _ = selected_logprobs(hidden, weight, targets, inv, chunk=16)
        lp.sum().backward()
    ref = torch.log_softmax((hidden @ weight.T) * inv[:, None], dim=-1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    g_h, g_w = torch.autograd.grad(ref.sum(), (hidden, weight))
    torch.testing.assert_close(hidden.grad, g_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, g_w, atol=1e-5, rtol=1e-5)


def test_training_micro_step_is_sync_free():
    """What each micro-batch of the K1.5 update runs on the device: the packed forward with checkpointing and
    max-logit tracking, per-target temperatures, the loss, the backward."""
    model = _model()
    engine = TrainingEngine(model, [], 0)
    prompts, responses = _batch()
    temps = [0.7, 1.0, 0.0, 1.3, 0.9, 1.0, 0.5]
    host = pack(prompts, responses, 0, engine.attention)
    inv = torch.tensor(inverse_temperatures(temps, len(prompts)), dtype=torch.float32)[host.target_seq]
    old, adv, w = torch.randn(len(prompts)), torch.randn(len(prompts)), torch.full((len(prompts),), 1 / len(prompts))
    with no_host_sync("cpu"):
        scores = engine.score_packed(host, inv)
        loss = k15_loss((scores.logprobs * scores.mask).sum(-1), old, adv, w, tau=0.3)
        loss.backward()
    want = engine.score(prompts, responses, temps)  # the same numbers through the public entry
    torch.testing.assert_close(scores.logprobs, want.logprobs)


def test_optimizer_step_reads_the_device_once_not_once_per_parameter():
    """The step reads the gradient norm (to refuse a non-finite step); every optimizer's update sums wait on the
    device for the next read (here ``update_rms``'s, after the step). It used to read Σ(Δw)² once per AdamW
    parameter, then once per step besides the norm. (SGD: an optimizer that reads nothing back itself.)"""
    model = _model()
    params = list(model.parameters())
    engine = TrainingEngine(model, [torch.optim.SGD(params, lr=1e-2)], 0)
    prompts, responses = _batch()
    engine.score(prompts, responses, 1.0).logprobs.sum().backward()
    with HostSyncChecker(compute_device="cpu") as checker:
        engine.step()
    reads = [f.op for f in checker.found if f.op in READS]
    assert len(params) > 10 and len(reads) == 1, reads
    assert set(engine.update_rms) == {"sgd"} and engine.update_rms["sgd"] > 0


def _update_reads(model, samples, token_budget: int, **kw) -> tuple[int, list[str]]:
    """Run the real update loop (``rl.algo.update.rl_update`` on a planned share) on a CPU standing in for the
    device; returns its micro-batches and the host reads it made."""
    from rl.algo.batches import plan_update
    from tests.test_algorithm import settings

    s = settings(minibatches=2, token_budget=token_budget, drop_equal_groups=False, **kw)
    engine = TrainingEngine(model, [torch.optim.SGD(list(model.parameters()), lr=1e-2)], 0, qk_clip=True,
                            qk_clip_tau=100.0)
    (batch,) = plan_update(samples, s, 1, seed=0)
    with HostSyncChecker(compute_device="cpu") as checker:
        steps = list(rl_update(engine, batch, s))
    assert len(steps) == 2
    return sum(len(parts) for parts in batch.steps), [f.op for f in checker.found if f.op in READS]


def test_the_update_loop_reads_the_device_a_fixed_number_of_times_per_step_not_per_micro_batch():
    """The trainer's batch lives on the device: losses and diagnostics accumulate there and are read once per
    optimizer step (with the step's gradient norm, QK-Clip maxima and the last step's update sums; the last step's
    in one more read), however many micro-batches the step has; with the π_old recompute and a mismatch correction
    too. A read per micro-batch (``float(loss)``, a diagnostic's ``.item()``) makes the counts differ."""
    from rl.algo.mismatch import Correction
    from tests.conftest import make_sample

    rng = random.Random(4)
    samples = [make_sample(g, [rng.randrange(2, VOCAB) for _ in range(4)], [rng.randrange(2, VOCAB) for _ in range(5)],
                           [-1.0] * 5, float(k % 2), temperature=0.9) for g in range(4) for k in range(4)]
    for extra in ({}, {"recompute_old": True, "correction": Correction("tis", "sequence", 2.0)}):
        few, reads_few = _update_reads(_model(), samples, 10_000, **extra)
        many, reads_many = _update_reads(_model(), samples, 9, **extra)
        assert few == 2 and many == 16, (few, many)  # one micro-batch per step, against one per sample
        assert reads_few == reads_many, (reads_few, reads_many)
        assert len(reads_few) == 2 + 1, reads_few  # one per step, one for the last step's update sums
