"""An in-place weight update of an MoE model in vLLM (engines.inference.vllm_engine, vLLM's layer-wise reload):
the engine then samples exactly as a fresh load of the new weights would, against the trainer's recompute and the
native engine on them. One vLLM start-up (tens of seconds), a tiny native Mixtral, in a child process: vLLM sets up
its process-wide distributed state for the first model a process loads (test_vllm_engine's dense one has no
expert-parallel group, which an MoE model needs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.io.hf_io import save_pretrained
from engines.model.native.causal_lm import CausalLM
from engines.training.engine import TrainingEngine
from tests.conftest import tiny_config

vllm_engine = pytest.importorskip("engines.inference.vllm_engine")
if not vllm_engine.vllm_available():
    pytest.skip("vLLM is not installed here (make setup installs it)", allow_module_level=True)

PROMPTS = ["Question: Mia has 3 apples.", "Q", "Answer: 1+2=3, 3*2=6. The", "Question: Leo has 5 pens and 2 more"]


def _mixtral(tokenizer, seed: int) -> CausalLM:
    # head_dim 32 (vLLM's CPU attention has no kernel for smaller heads); every matrix and stacked expert N(0, 0.2)
    # so that logits are far from uniform and a wrong expert would show
    cfg = tiny_config(tokenizer.vocab_size, model_type="mixtral", hidden_size=64, intermediate_size=96,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, num_experts=4,
                      num_experts_per_tok=2, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.2)
    return model.eval()


def _serve(request: dict) -> dict:
    """In the child: vLLM on ``old``, then updated in place to ``new`` and back (the tensors as stored on disk, as
    a trainer sends them); the sampled and greedy tokens and log-probs at each stage."""
    from engines.inference.vllm_engine import VllmEngine
    from engines.model.io.hf_io import read_tensors

    engine = VllmEngine(request["old"], request["eos_ids"], max_seq_len=256, max_num_seqs=8, dtype="float32",
                        kv_cache_bytes=64 << 20)
    prompts = request["prompts"]
    sampled = [SamplingParams(0.7, 24, seed=100 + i) for i in range(len(prompts))]

    def run(params):
        return [[list(c.token_ids), list(c.logprobs)] for c in engine.generate(prompts, params)]

    out = {"weight_load": engine.weight_load, "before": run(sampled)}
    engine.load_weights(iter(read_tensors(request["new"]).items()))
    out["after"], out["greedy"] = run(sampled), run(SamplingParams(0.0, 24))
    engine.load_weights(iter(read_tensors(request["old"]).items()))
    out["back"] = run(sampled)
    return out


def _max_diff(got, model, prompts) -> float:
    with torch.no_grad():
        lp, mask = TrainingEngine(model, [], 0).response_logprobs(prompts, [t for t, _ in got], 0.7)
    return max(float((torch.tensor(g) - lp[i][mask[i]]).abs().max()) for i, (_, g) in enumerate(got))


def test_vllm_moe_update_in_place_samples_as_a_fresh_load_of_the_new_weights(tokenizer, tmp_path):
    """vLLM's CPU build packs the experts for its fused-MoE kernel at start-up; an update must pack the new ones
    too (vLLM 0.32 alone copied them unpacked into the packed tensors: log-probs 3.2 apart on average)."""
    old, new = _mixtral(tokenizer, 0), _mixtral(tokenizer, 1)
    save_pretrained(old, tokenizer, tmp_path / "old")
    save_pretrained(new, tokenizer, tmp_path / "new")
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    request = dict(old=str(tmp_path / "old"), new=str(tmp_path / "new"), eos_ids=list(tokenizer.eos_ids),
                   prompts=prompts)
    p = subprocess.run([sys.executable, "-m", "tests.test_vllm_moe_update"], input=json.dumps(request),
                       capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
    assert line is not None, p.stderr[-3000:]
    got = json.loads(line)
    assert got["weight_load"] == "reload"  # what auto picks for MoE layers
    assert _max_diff(got["before"], old, prompts) <= 1e-4  # a fresh load: the trainer's numbers to float32 rounding
    assert [t for t, _ in got["after"]] != [t for t, _ in got["before"]]
    assert _max_diff(got["after"], new, prompts) <= 1e-4
    want = InferenceEngine(new, tokenizer.eos_ids, tokenizer.pad_id).generate(prompts, SamplingParams(0.0, 24))
    assert [t for t, _ in got["greedy"]] == [c.token_ids for c in want]
    assert got["back"] == got["before"]  # and back: a second update packs again


if __name__ == "__main__":
    print(json.dumps(_serve(json.loads(sys.stdin.read()))), flush=True)
