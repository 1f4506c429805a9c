"""The training path's flex_attention on a GPU, proven on CPU where a CPU can prove it: which models its
kernel takes (and ``auto``'s fallback below that), a bounded number of compiled variants over any row
widths, grad modes and max-logit requests, and the dense path taking over when compiling fails.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

import engines.model.native.attention as attention
import engines.training.engine as engine_mod
from benchmarks.rollout import MODELS
from benchmarks.train_step import QWEN3_1B
from engines.model.native.arch import make_config
from engines.model.native.attention import FLEX_FALLBACK, attention_dims, why_not_flex
from engines.model.native.causal_lm import CausalLM, attention_layers, reset_max_logits, track_max_logits
from engines.model.native.document_mask import FLEX_BLOCK
from engines.training.engine import TrainingEngine, resolve_attention
from engines.training.packing import FLEX_MIN_ROW, flex_row_width, pack
from tests.conftest import tiny_config
from tests.test_fp8 import K2_TINY
from tests.test_packed_training import KINDS, VOCAB
from tests.test_packed_training import _model as packed_model

#: What the CUDA tests build: conftest's tiny model (test_algorithm), test_training_engine's, every kind of
#: test_packed_training (its CUDA test asks for flex explicitly, with head_dim 16), and the benchmarks' GPU models.
GPU_TEST_CONFIGS = {
    "conftest tiny": tiny_config(400),
    "test_training_engine": tiny_config(37),
    **{f"packed {k}": tiny_config(VOCAB, intermediate_size=40, **kw) for k, kw in KINDS.items()},
    "packed window (CUDA flex test)": packed_model("window", head_dim=16).config,
    "k2 tiny (MLA)": make_config("kimi_k2", **K2_TINY),
    **{f"benchmark {k}": c for k, c in MODELS.items()},
    "benchmark 1b": QWEN3_1B,
}
#: The ones the CUDA tests run with attention="flex" explicitly: they must be eligible.
EXPLICIT_FLEX = {"packed window (CUDA flex test)"}


@pytest.fixture
def fresh_fallback(monkeypatch):
    """A process with no compiled-flex failure yet (restored afterwards)."""
    monkeypatch.setattr(FLEX_FALLBACK, "count", 0)
    monkeypatch.setattr(FLEX_FALLBACK, "reason", None)
    return FLEX_FALLBACK


@pytest.fixture
def compiled_on_cpu(monkeypatch, fresh_fallback):
    """The training path compiles flex on CPU as it does on CUDA (fresh compile caches before and after)."""
    torch._dynamo.reset()
    monkeypatch.setattr(attention, "FLEX_COMPILED_DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(attention, "_compiled", {})
    yield
    torch._dynamo.reset()


def test_why_not_flex_names_the_kernels_limits():
    assert why_not_flex(16, 16) is None and why_not_flex(192, 128) is None and why_not_flex(96, 96) is None
    assert "at least 16" in why_not_flex(8, 8)
    assert "at least 16" in why_not_flex(24, 8)  # the value's dimension counts too (MLA has its own)
    assert "tile" in why_not_flex(64, 64, block=64) and why_not_flex(64, 64, block=256) is None


def test_mla_dims_are_the_latent_attentions_own():
    cfg = make_config("kimi_k2", **K2_TINY)
    assert attention_dims(cfg) == (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)
    assert attention_dims(tiny_config(37)) == (8, 8)


@pytest.mark.parametrize("name", list(GPU_TEST_CONFIGS))
def test_every_gpu_test_model_is_eligible_or_falls_back(name, monkeypatch):
    """``auto`` on CUDA takes flex exactly when the kernel takes the model, sdpa otherwise; explicit flex on an
    ineligible model is refused at construction instead of failing inside the compiler."""
    monkeypatch.setattr(engine_mod, "_noticed", set())
    cfg = GPU_TEST_CONFIGS[name]
    why = why_not_flex(*attention_dims(cfg))
    assert resolve_attention("auto", "cuda", cfg) == ("flex" if why is None else "sdpa")
    assert resolve_attention("auto", "cpu", cfg) == "sdpa"
    assert resolve_attention("flex", "cpu", cfg) == "flex"  # flex's unfused reference takes any head size
    if name in EXPLICIT_FLEX:
        assert why is None
    if why is None:
        assert resolve_attention("flex", "cuda", cfg) == "flex"
    else:
        with pytest.raises(ValueError, match="at least 16"):
            resolve_attention("flex", "cuda", cfg)


def test_auto_below_the_kernels_head_size_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(engine_mod, "_noticed", set())
    cfg = tiny_config(37)
    with caplog.at_level(logging.INFO, logger="engines.training.engine"):
        picks = [resolve_attention("auto", "cuda", cfg) for _ in range(3)]
    assert picks == ["sdpa"] * 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "sdpa" in lines[0] and "\n" not in lines[0], lines


def test_flex_rows_come_in_few_widths_of_whole_blocks():
    widths = {flex_row_width(n) for n in range(1, 16385)}
    assert widths == {FLEX_MIN_ROW << i for i in range(6)}  # 512 .. 16384: six shapes for a 16 K budget
    assert flex_row_width(10, width=100) == FLEX_BLOCK and flex_row_width(10, width=256) == 256
    prompts, responses = [[3] * 7] * 5, [[4] * 9] * 5
    assert pack(prompts, responses, 0, "flex", width=100).ids.shape[1] % FLEX_BLOCK == 0


def _sequences(tokens: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and responses of about ``tokens`` tokens in all."""
    rng = random.Random(seed)
    prompts, responses, total = [], [], 0
    while total < tokens:
        p, r = rng.randint(1, 40), rng.randint(1, 40)
        prompts.append([rng.randrange(2, VOCAB) for _ in range(p)])
        responses.append([rng.randrange(2, VOCAB) for _ in range(r)])
        total += p + r
    return prompts, responses


def _mixed_window_model() -> CausalLM:
    """Sliding and full layers (two mask rules) and head dimension 16 (flex's kernel size)."""
    torch.manual_seed(0)
    model = CausalLM(tiny_config(VOCAB, intermediate_size=40, head_dim=16, model_type="qwen3", sliding_window=6,
                                 layer_types=["sliding_attention", "full_attention"]))
    return model.requires_grad_(False)  # flex has no CPU backward: grad mode on, inputs without gradients


@pytest.mark.usefixtures("compiled_on_cpu")
def test_recompiles_stay_under_the_limit_over_widths_grad_modes_and_aux():
    """Row widths x grad mode x max-logit tracking, through the compiled path, with a hard failure at the recompile
    limit (lowered to 4, half of torch's default): a compiled entry per width (the old dynamic=False) needs
    3 widths x 2 windows = 6 entries per grad mode and fails; width-generic entries need 2 per window."""
    model = _mixed_window_model()
    dense = TrainingEngine(model, [], 0, attention="sdpa")
    flex = TrainingEngine(model, [], 0, attention="flex")
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=4):
        for width in (512, 1024, 2048):
            prompts, responses = _sequences(width * 3 // 4, seed=width)
            assert pack(prompts, responses, 0, "flex").ids.shape[1] == width
            for grad in (False, True):
                for track in (False, True):
                    track_max_logits(model, track)
                    with torch.set_grad_enabled(grad):
                        got = flex.score(prompts, responses, 0.8)
                    assert FLEX_FALLBACK.reason is None, FLEX_FALLBACK.reason  # a limit hit would land here
                    if not grad and track:
                        want = dense.score(prompts, responses, 0.8)
                        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=1e-4)
    assert FLEX_FALLBACK.count == 0


@pytest.mark.usefixtures("compiled_on_cpu")
def test_a_recompile_limit_hit_takes_the_dense_path_not_unfused_flex():
    """Past torch's recompile limit flex would run unfused with every score in float32 (out of memory on a GPU at
    16 K tokens); the compiled path fails there instead and the dense path gives the same log-probs."""
    model = _mixed_window_model()
    dense = TrainingEngine(model, [], 0, attention="sdpa")
    flex = TrainingEngine(model, [], 0, attention="flex")
    with torch._dynamo.config.patch(recompile_limit=1):
        for width in (512, 1024):
            prompts, responses = _sequences(width * 3 // 4, seed=width)
            with torch.no_grad():
                got = flex.score(prompts, responses, 1.0).logprobs
            torch.testing.assert_close(got, dense.score(prompts, responses, 1.0).logprobs, atol=1e-4, rtol=1e-4)
    assert "RecompileLimit" in FLEX_FALLBACK.reason and flex.attention_fallback == 1


def test_a_failing_flex_compile_falls_back_to_the_dense_path_once(monkeypatch, caplog, fresh_fallback):
    """Compiling flex raises (as inductor did for head_dim 8 on the H100): the same log-probs come from the dense
    path, one warning is logged, and the engine reports it."""
    def broken(grad):
        def run(*args):
            raise RuntimeError("LoweringException: NotImplementedError: NYI: embedding dimension\nsecond line")
        return run

    monkeypatch.setattr(attention, "FLEX_COMPILED_DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(attention, "_compiled_flex", broken)
    model = _mixed_window_model()
    track_max_logits(model)
    prompts, responses = _sequences(200, seed=1)
    want = TrainingEngine(model, [], 0, attention="sdpa").score(prompts, responses, 0.8).logprobs
    want_max = [a.max_logits for a in attention_layers(model)]
    engine = TrainingEngine(model, [], 0, attention="flex")
    assert engine.attention_fallback == 0
    with caplog.at_level(logging.WARNING, logger="engines.model.native.attention"):
        for _ in range(2):
            reset_max_logits(model)
            torch.testing.assert_close(engine.score(prompts, responses, 0.8).logprobs, want)
    warnings = [r.getMessage() for r in caplog.records if r.name == "engines.model.native.attention"]
    assert len(warnings) == 1 and "dense" in warnings[0] and "\n" not in warnings[0], warnings
    assert engine.attention_fallback == 1 and FLEX_FALLBACK.count == 2 * model.config.num_hidden_layers
    for a, m in zip(attention_layers(model), want_max, strict=True):  # QK-Clip's statistic survives the fallback
        torch.testing.assert_close(a.max_logits, m)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (flex_attention's Triton kernel)")
def test_cuda_flex_training_stays_compiled_over_widths_grad_modes_and_aux(fresh_fallback):
    """The GPU version of the recompile check, with gradients: no limit hit, no fallback, dense-path results."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CausalLM(tiny_config(VOCAB, intermediate_size=40, head_dim=16, model_type="qwen3", sliding_window=6,
                                 layer_types=["sliding_attention", "full_attention"])).cuda()
    dense = TrainingEngine(model, [], 0, attention="sdpa")
    flex = TrainingEngine(model, [], 0, attention="flex")
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=4):
        for width in (512, 1024, 2048, 4096):
            prompts, responses = _sequences(width * 3 // 4, seed=width)
            for grad in (False, True):
                for track in (False, True):
                    track_max_logits(model, track)
                    model.activation_checkpointing = grad and track  # its recompute runs with tracking off
                    with torch.set_grad_enabled(grad):
                        got = flex.score(prompts, responses, 0.8)
                        want = dense.score(prompts, responses, 0.8)
                        if grad:
                            got.logprobs.sum().backward()
                    assert FLEX_FALLBACK.reason is None, FLEX_FALLBACK.reason
                    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=1e-4)
    model.zero_grad(set_to_none=True)
    assert flex.attention_fallback == 0
