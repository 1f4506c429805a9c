"""vLLM's CPU build serving a family the native code lacks: its sampled log-probs against the transformers backend's
recompute (tests/vllm_check.py; the survey of every family is in docs/models.md)."""

from __future__ import annotations

import pytest

from tests.vllm_check import run_family

vllm_engine = pytest.importorskip("engines.inference.vllm_engine")
if not vllm_engine.vllm_available():
    pytest.skip("vLLM is not installed here (make setup installs it)", allow_module_level=True)

#: Families vLLM's CPU build serves in float32 and whose log-probs agree (docs/models.md lists the others); one
#: start-up costs 30–80 s here, so the suite runs the one that differs most from Llama: MoE, sinks, sliding window.
SERVED = ["gpt_oss"]


# slow tier: test_hf_families_run's gpt_oss run checks the same agreement in make test (its iteration 0 scores what
# vLLM sampled before any update, then again after each in-place update); this is the standalone check, 45 s
@pytest.mark.slow
@pytest.mark.parametrize("family", SERVED)
def test_vllm_samples_what_the_transformers_backend_scores(family, tokenizer):
    r = run_family(family, tokenizer)
    assert r.loads and r.generates, r.error
    assert r.tokens == 64
    # float32 on both sides, different kernels: the same numbers to rounding (as the native family's vLLM test)
    assert r.max_diff < 1e-4, r
