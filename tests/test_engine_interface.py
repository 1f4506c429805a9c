"""The rollout engine interface (engines.inference.base): what the controller and the checkpoint engine
use, held by the native engine, so a second engine is a second implementation."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

from engines.inference.base import RolloutEngine
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.layout import hub_state, model_tensors
from engines.model.native.causal_lm import build_model


def test_the_native_engine_implements_every_method_with_the_interfaces_signature():
    assert not InferenceEngine.__abstractmethods__
    for name in RolloutEngine.__abstractmethods__:
        want, got = getattr(RolloutEngine, name), getattr(InferenceEngine, name)
        if isinstance(want, property):
            assert isinstance(got, property), name
            continue
        assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), name


def test_the_controller_and_the_weight_path_use_only_the_interface():
    """The rollout worker and partial rollout call no engine method outside ``RolloutEngine``."""
    root = Path(__file__).resolve().parents[1]
    allowed = set(dir(RolloutEngine)) | set(RolloutEngine.__annotations__)
    for f in ("rl/loop/workers.py", "rl/rollout/partial.py"):
        tree = ast.parse((root / f).read_text())
        for node in ast.walk(tree):
            chain = node
            # self.engine.X / engine.X inside the rollout side
            if isinstance(chain, ast.Attribute) and isinstance(chain.value, ast.Attribute) and \
                    chain.value.attr == "engine" and isinstance(chain.value.value, ast.Name) and \
                    chain.value.value.id == "self" and _in_rollout_worker(tree, node):
                assert chain.attr in allowed, f"{f}:{node.lineno} uses engine.{chain.attr}"
            if f.endswith("partial.py") and isinstance(chain, ast.Attribute) and \
                    isinstance(chain.value, ast.Name) and chain.value.id == "engine":
                assert chain.attr in allowed, f"{f}:{node.lineno} uses engine.{chain.attr}"


def _in_rollout_worker(tree, node) -> bool:
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name == "RolloutWorker":
            return any(n is node for n in ast.walk(cls))
    return False


def test_swapped_weights_are_served_and_packed_and_placements_address_them(tiny_model, tokenizer):
    """``swap_weights`` serves an update loaded aside (greedy tokens follow it), ``served_weights`` packs
    exactly what is served, and ``weight_placements`` points at the bytes holding each checkpoint tensor."""
    eng = InferenceEngine(tiny_model, tokenizer.eos_id, tokenizer.pad_id)
    prompt = tokenizer.encode("Question: Mia has 3 apples.")
    greedy = SamplingParams(0.0, 8)
    before = eng.generate([prompt], greedy)[0].token_ids
    other = build_model(tiny_model.config)
    with torch.no_grad():
        for t in model_tensors(other).values():
            t.normal_(0, 0.5)
    eng.swap_weights({k: v.detach().clone() for k, v in model_tensors(other).items()})
    after = eng.generate([prompt], greedy)[0].token_ids
    ref = InferenceEngine(other, tokenizer.eos_id, tokenizer.pad_id).generate([prompt], greedy)[0].token_ids
    assert after == ref and after != before
    served = eng.served_weights()
    assert served.keys() == hub_state(other).keys()
    for k, v in hub_state(other).items():
        torch.testing.assert_close(served[k], v, rtol=0, atol=0)
    tensors = eng.named_tensors()
    for name, (own, offset) in eng.weight_placements().items():
        t = tensors[own]
        start = t.data_ptr() + offset
        assert t.data_ptr() <= start < t.data_ptr() + t.numel() * t.element_size(), name
        want = served[name]
        got = torch.empty(0, dtype=want.dtype).set_(t.untyped_storage(), (start - t.untyped_storage().data_ptr())
                                                     // want.element_size(), want.shape)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_each_engine_declares_how_it_takes_a_weight_update(tiny_model, tokenizer):
    """The weight-update mode is a declared class attribute, not a probed one: the native engine swaps an update
    in at its commit and refuses the stream methods; vLLM streams it, with the interface's stream signatures."""
    import pytest

    from engines.inference.vllm_engine import VllmEngine

    assert InferenceEngine.weight_update == "swap" and VllmEngine.weight_update == "stream"
    assert "weight_update" in RolloutEngine.__annotations__
    for name in ("begin", "feed", "commit", "abort"):
        want, got = getattr(RolloutEngine, name), getattr(VllmEngine, name)
        assert got is not want, name  # vLLM implements each one itself
        assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), name
    assert not any(hasattr(cls, "streams_weights") for cls in (RolloutEngine, InferenceEngine, VllmEngine))
    eng = InferenceEngine(tiny_model, tokenizer.eos_id, tokenizer.pad_id, kv_cache_bytes=1 << 20)
    with pytest.raises(NotImplementedError, match="'swap', not by stream: it has no begin"):
        eng.begin(1)
