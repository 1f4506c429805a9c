"""What the trainer does for speed changes nothing it computes: one rank under mixed precision keeps its layers
gathered from forward to backward (the same numbers as casting them again), compiled decoder layers give the eager
layers' loss, gradients and step, and the step is timed (forward and backward apart from the optimizer) without a
host read of its own."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engines.model.native.causal_lm import CausalLM, track_max_logits
from engines.model.native.compile import CACHE_ENV, compile_layers, is_compiled, use_compile_cache
from engines.model.sharded import local_tensor
from engines.training import timing
from engines.training.distributed import init_distributed, shard_model
from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers
from tests.conftest import sharp_model, tiny_config

VOCAB, PAD = 37, 0


def _model(**kw) -> CausalLM:
    model = sharp_model(tiny_config(VOCAB, model_type="qwen3", **kw), seed=0)
    track_max_logits(model, True)
    return model


def _batch(seed: int, n: int = 6) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 7))] for _ in range(n)]
    responses = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    return prompts, responses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_rank(fn):
    """``fn()`` inside a one-rank gloo group (skipped when this process already has a group)."""
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    init_distributed(0, 1, f"tcp://127.0.0.1:{_free_port()}", timeout_s=30)
    try:
        return fn()
    finally:
        dist.destroy_process_group()


def _step(engine: TrainingEngine, seed: int, score_first: bool = False) -> dict[str, torch.Tensor]:
    """One optimizer step on batch ``seed`` (after a no-grad scoring pass with ``score_first``, as the π_old
    recompute runs): the loss, every gradient and every weight after the step, as this rank's local tensors."""
    prompts, responses = _batch(seed)
    if score_first:
        with torch.no_grad():
            engine.response_logprobs(prompts, responses, 1.0)
    lp, _ = engine.response_logprobs(prompts, responses, 1.0)
    loss = -lp.sum() / sum(map(len, responses))
    loss.backward()
    out = {"loss": loss.detach().clone()}
    out.update({f"grad/{n}": local_tensor(p.grad).clone() for n, p in engine.model.named_parameters()})
    engine.step()
    out.update({f"param/{n}": local_tensor(p).detach().clone() for n, p in engine.model.named_parameters()})
    return out


def test_one_rank_under_mixed_precision_keeps_layers_gathered_and_steps_exactly_as_recasting():
    """bfloat16 compute over float32 master weights on one rank: ``shard_model`` leaves each layer gathered after
    its forward (``reshard_after_forward`` False, what the one-rank default picks), so the backward casts nothing
    again; two Muon steps, each after a no-grad scoring pass, are bit-identical to the recasting layout's."""

    def run(reshard: bool | None) -> dict:
        model = shard_model(_model(), param_dtype="bfloat16", reshard_after_forward=reshard)
        engine = TrainingEngine(model, build_optimizers(model, "muon", 1e-2, 0.1), PAD, max_grad_norm=1e9)
        layers = list(model.model.layers)
        flags = [layer._get_fsdp_state()._fsdp_param_group._reshard_after_forward for layer in layers]
        prompts, responses = _batch(0)
        with torch.no_grad():  # no backward follows: the engine frees what the forward gathered
            engine.response_logprobs(prompts, responses, 1.0)
        after_no_grad = [isinstance(p, DTensor) for p in layers[0].parameters()]
        lp, _ = engine.response_logprobs(prompts, responses, 1.0)
        after_forward = [isinstance(p, DTensor) for p in layers[0].parameters()]
        (lp.sum() * 0).backward()
        engine.model.zero_grad(set_to_none=True)
        steps = [_step(engine, seed, score_first=True) for seed in (1, 2)]
        return {"flags": flags, "no_grad": after_no_grad, "forward": after_forward, "steps": steps}

    recast, kept = _one_rank(lambda: (run(True), run(None)))
    assert recast["flags"] == [True, True] and kept["flags"] == [False, False]
    assert all(recast["no_grad"]) and all(kept["no_grad"])  # sharded again after a no-grad forward, either way
    assert all(recast["forward"]) and not any(kept["forward"])  # kept: gathered between forward and backward
    for a, b in zip(recast["steps"], kept["steps"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_compile_cache_goes_to_the_project_cache_unless_the_environment_names_one(monkeypatch, tmp_path):
    for var in CACHE_ENV:  # recorded, so the test's changes are undone afterwards
        monkeypatch.setenv(var, "")
    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    got = use_compile_cache()
    assert got == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile" / "inductor"),
                   "TRITON_CACHE_DIR": str(tmp_path / "mine")}
    assert (tmp_path / "compile" / "inductor").is_dir()
    # importing torch._dynamo writes torch's temporary default in: that is no one's choice, so it is replaced
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(Path(default_cache_dir()) / "triton" / "0"))
    assert use_compile_cache() == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile" / "inductor"),
                                   "TRITON_CACHE_DIR": str(tmp_path / "compile" / "triton")}


@pytest.mark.slow  # inductor's C++ compile takes about 40 s on two cores; trainer.compile is off by default
def test_compiled_layers_give_the_eager_loss_gradients_and_step(monkeypatch, tmp_path):
    """One training step through the engine (packed documents, max-logit tracking, SGD so that the update is the
    clipped gradient itself) with every decoder layer compiled by inductor (C++ on CPU), against the same model
    eager, in float32. Inductor fuses the norms, RoPE and SwiGLU and may reorder their float32 sums, so the two agree
    to rounding, not bitwise: a few ulps per fused op (float32's ulp is 1.2e-7 relative) through two layers and
    back; rtol 1e-5 / atol 1e-6 leaves ~10x room over what this measures (about 1e-6 at most) and is far below any
    real error (a wrong mask, norm or rotation moves these numbers by 1e-2 or more)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    runs = {}
    for compiled in (False, True):
        model = _model()
        if compiled:
            assert compile_layers(model) == 2 and all(is_compiled(layer) for layer in model.model.layers)
        params = list(model.parameters())
        engine = TrainingEngine(model, [torch.optim.SGD(params, lr=0.1)], PAD, max_grad_norm=1e9, qk_clip=True)
        runs[compiled] = _step(engine, 3)
        runs[compiled]["max_logit"] = torch.tensor(engine.last_step["max_logit"])
    for k, want in runs[False].items():
        torch.testing.assert_close(runs[True][k], want, rtol=1e-5, atol=1e-6, msg=k)


def test_the_step_times_forward_and_backward_apart_from_the_optimizer(monkeypatch):
    """The marks: the first differentiable forward after the previous step (a no-grad pass before it does not
    start the clock), the step's start and its end; on CPU the host clock, here a fake one."""
    now = iter([10.0, 12.5, 13.25, 20.0, 21.0, 21.5])
    monkeypatch.setattr(timing, "clock", lambda: next(now))
    model = _model()
    engine = TrainingEngine(model, build_optimizers(model, "muon", 1e-2, 0.0), PAD)
    prompts, responses = _batch(0)
    with torch.no_grad():
        engine.response_logprobs(prompts, responses, 1.0)
    for _ in range(2):  # two micro-batches: the clock starts at the first
        lp, _ = engine.response_logprobs(prompts, responses, 1.0)
        lp.sum().backward()
    engine.step()
    assert engine.step_metrics.seconds() == {"fwd_bwd_s": 2.5, "optimizer_s": 0.75}
    last = engine.last_step
    assert last["train_fwd_bwd_s"] == 2.5 and last["train_optimizer_s"] == 0.75 and "update_rms/muon" in last
    lp, _ = engine.response_logprobs(prompts, responses, 1.0)  # the next step starts its own clock
    lp.sum().backward()
    engine.step()
    assert engine.step_metrics.seconds() == {"fwd_bwd_s": 1.0, "optimizer_s": 0.5}


@pytest.mark.slow
def test_compiled_layers_under_one_rank_mixed_precision_stay_as_close_to_float32_as_eager():
    """The GPU layout on CPU: layers compiled, then wrapped by FSDP2 (one rank, bfloat16 compute, kept gathered);
    FSDP's hooks run around the compiled forwards. bfloat16 rounds differently once inductor fuses (it keeps the
    fused intermediates in float32), so the test asks what matters: the compiled step's loss and gradients are no
    further from the float32 step's than the eager bfloat16 step's are (within 1.5x; both about 1e-2 relative)."""

    def run(dtype: str, compiled: bool) -> dict:
        model = _model()
        if compiled:
            compile_layers(model)
        model = shard_model(model, param_dtype=dtype)
        engine = TrainingEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], PAD, max_grad_norm=1e9)
        return _step(engine, 5)

    ref, eager, compiled = _one_rank(lambda: (run("float32", False), run("bfloat16", False), run("bfloat16", True)))
    for k, want in ref.items():
        if k.startswith("param/"):
            continue
        err_eager = (eager[k].float() - want).norm() / want.norm()
        err_compiled = (compiled[k].float() - want).norm() / want.norm()
        assert err_compiled <= 1.5 * err_eager + 1e-3, (k, float(err_compiled), float(err_eager))
        assert err_compiled < 5e-2, k


def test_trainer_compile_setting_resolves_per_device_and_backend():
    from rl.config import TrainerConfig
    from rl.settings import trainer_compile

    assert TrainerConfig().compile is False  # off by default until a GPU check has run it
    assert TrainerConfig(compile="auto").compile == "auto" and TrainerConfig(compile=True).compile is True
    with pytest.raises(ValueError):
        TrainerConfig(compile="sometimes")
    choices: list = []
    assert trainer_compile("auto", "cuda", "native", False, choices) is True
    assert trainer_compile("auto", "cpu", "native", False, choices) is False
    assert choices == [("trainer.compile", "on", "auto on cuda"), ("trainer.compile", "off", "auto on cpu")]
    assert trainer_compile(True, "cpu", "native", False, choices) is True
    assert trainer_compile(False, "cuda", "native", False, choices) is False
    assert trainer_compile(True, "cuda", "transformers", False, choices) is False
    assert trainer_compile("auto", "cuda", "native", True, choices) is False
    assert choices[2:] == [("trainer.compile", "off", "the transformers backend's layers run eagerly"),
                           ("trainer.compile", "off", "auto on cuda (model.lora: the adapted layers run eagerly)")]


def test_a_compiling_policy_spec_compiles_the_layers_it_builds():
    from engines.training.parallel_dims import ParallelDims
    from engines.training.policy import PolicySpec, build_policy

    cfg = tiny_config(VOCAB)
    for compiled in (False, True):
        model = build_policy(cfg, PolicySpec(compile=compiled), ParallelDims(workers=1), "cpu")
        assert [is_compiled(layer) for layer in model.model.layers] == [compiled, compiled]
