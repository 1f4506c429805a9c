"""A CPU replica's linear layers through oneDNN (engines.inference.cpu_linear): the same outputs as torch's GEMM,
gradients still correct when the served model is also trained, and no other model touched."""

import copy

import pytest
import torch

from engines.inference import cpu_linear
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams

needs_onednn = pytest.mark.skipif(not cpu_linear.available(), reason="oneDNN's linear is not available here")


def forward(model, ids):
    return model(ids, torch.arange(ids.shape[1])[None])


@needs_onednn
def test_routed_linears_give_torchs_outputs_and_leave_other_models_alone(tiny_model):
    plain = copy.deepcopy(tiny_model)
    routed = copy.deepcopy(tiny_model)
    linears = sum(type(m) is torch.nn.Linear for m in routed.modules())
    assert cpu_linear.route_linears(routed, min_features=0) == linears > 0
    assert cpu_linear.route_linears(copy.deepcopy(tiny_model)) == 0  # too narrow to gain (MIN_FEATURES)
    assert all("forward" in vars(m) for m in routed.modules() if type(m) is torch.nn.Linear)
    assert not any("forward" in vars(m) for m in plain.modules() if type(m) is torch.nn.Linear)
    ids = torch.randint(2, 60, (1, 100))  # 100 rows: padded to 128 for oneDNN
    with torch.no_grad():
        torch.testing.assert_close(forward(routed, ids), forward(plain, ids), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_a_routed_model_trained_as_well_gets_torchs_gradients(tiny_model):
    plain = copy.deepcopy(tiny_model).train()
    routed = copy.deepcopy(tiny_model).train()
    cpu_linear.route_linears(routed, min_features=0)
    ids = torch.randint(2, 60, (2, 40))
    for m in (plain, routed):
        forward(m, ids).logsumexp(-1).mean().backward()
    for (name, a), b in zip(plain.named_parameters(), routed.parameters(), strict=True):
        assert b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, atol=0, rtol=0)  # the same F.linear path when recording grads


@needs_onednn
def test_the_engine_routes_a_wide_models_linears_on_a_cpu_and_decodes_the_same(tokenizer):
    """A model as wide as MIN_FEATURES, 72 sequences (padded to 128 rows, then fewer as they finish): the same
    tokens and logprobs as torch's GEMM."""
    from engines.model.native.causal_lm import CausalLM
    from tests.conftest import tiny_config

    torch.manual_seed(0)  # the usual init: logits of a real model's size (float32 rounding is relative to them)
    wide = CausalLM(tiny_config(tokenizer.vocab_size, hidden_size=cpu_linear.MIN_FEATURES, intermediate_size=64))
    prompts = [tokenizer.encode(f"Question: {i} apples.") for i in range(72)]
    outs = {}
    for onednn in (True, False):
        eng = InferenceEngine(copy.deepcopy(wide), tokenizer.eos_id, tokenizer.pad_id, onednn_linear=onednn)
        assert (eng.onednn_linears > 0) == onednn
        outs[onednn] = eng.generate(prompts, SamplingParams(1.0, 8, seed=3))
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_batches_are_padded_to_few_shapes():
    """oneDNN builds a kernel per shape: every batch of an RL rollout maps onto a few dozen, never more than
    twice its rows."""
    shapes = {cpu_linear.padded_rows(r) for r in range(1, 8193)}
    assert len(shapes) <= 40 and all(cpu_linear.padded_rows(r) >= r for r in range(1, 8193))
    assert all(cpu_linear.padded_rows(r) < 2 * r for r in range(9, 8193))
    assert [cpu_linear.padded_rows(r) for r in (1, 8, 9, 512, 513, 1025)] == [8, 8, 16, 512, 1024, 1280]


def test_a_bfloat16_engine_routes_only_what_onednn_runs_in_bfloat16_here(tokenizer):
    """A CPU without native bfloat16 (AVX2 only) has no oneDNN bfloat16 kernel: a bfloat16 replica keeps F.linear
    there (it used to be routed and fail at its first step), and decodes what an unrouted copy does; where the CPU
    has the kernel its layers are routed."""
    from engines.model.native.causal_lm import CausalLM
    from tests.conftest import tiny_config

    torch.manual_seed(0)
    wide = CausalLM(tiny_config(tokenizer.vocab_size, hidden_size=cpu_linear.MIN_FEATURES, intermediate_size=64))
    wide = wide.to(torch.bfloat16)
    prompts = [tokenizer.encode(f"Question: {i} apples.") for i in range(4)]
    outs = {}
    for onednn in (True, False):
        eng = InferenceEngine(copy.deepcopy(wide), tokenizer.eos_id, tokenizer.pad_id, onednn_linear=onednn)
        assert (eng.onednn_linears > 0) == (onednn and cpu_linear.available(torch.bfloat16))
        outs[onednn] = eng.generate(prompts, SamplingParams(0.0, 6, seed=3))
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
