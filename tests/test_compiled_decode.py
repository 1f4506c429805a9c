"""``rollout.compile``: the native engine's decoder layers compiled around the paged attention (what its decode graphs
capture on a GPU), checked on a CPU through inductor's C++ backend: the tokens of the eager engine, one step at a
time and several a read, for grouped-query and latent attention, and no compile after the first generate (the
guards hold across steps, batch sizes and each step's own cache object). The speed is a GPU's to measure
(``benchmarks.decode_sweep --compile``)."""

import pytest
import torch

from engines.inference.factory import EngineSettings
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.native.arch import make_config
from engines.model.native.causal_lm import build_model
from engines.model.native.compile import is_compiled
from rl.config import parse_config
from rl.errors import UserError

FAMILIES = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2),
    "deepseek_v3": dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=0,
                        first_k_dense_replace=2),  # latent attention, dense layers
}


def test_the_config_compiles_native_engines_on_gpu_workers_only():
    gpu = {"cluster": {"gpus_per_worker": 1}}
    assert parse_config({"rollout": {"compile": True}, **gpu}).rollout.compile is True
    with pytest.raises(UserError, match="rollout.compile: compiled layers are for GPU workers"):
        parse_config({"rollout": {"compile": True}})
    with pytest.raises(UserError, match=r"rollout.compile is the native engine's compiled layers, and rollout.engine "
                                        r"resolved to vllm \(set in rollout.engine\)"):
        parse_config({"rollout": {"compile": True, "engine": "vllm"}, **gpu})
    base = dict(model_dir="m", device="cuda", dtype="bfloat16", fp8=False, max_seq_len=None, max_num_seqs=4,
                kv_cache_bytes=1 << 20, max_batch_tokens=64, attention="torch", seed=0, compiled=True)
    assert EngineSettings(kind="native", **base).compiled
    with pytest.raises(ValueError, match="compiled: the vllm engine compiles its own model"):
        EngineSettings(kind="vllm", **base)


@pytest.mark.slow  # inductor's C++ compile takes 20-40 s a family on two cores; rollout.compile is for GPU workers
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_layers_decode_the_eager_tokens_and_compile_once(family):
    torch.manual_seed(0)
    cfg = make_config(family, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      max_position_embeddings=64, **FAMILIES[family])
    prompts = [[3, 4, 5, 6, 7, 8, 9], [3, 4, 5], [12], [20, 21, 22, 23, 24, 25], [30, 31]]
    params = [SamplingParams(1.0, 6 + 3 * i, ignore_eos=True, seed=i) for i in range(5)]

    def engine(compiled, steps=1):
        model = build_model(cfg, init=True, fused=True)
        model.load_state_dict(reference.state_dict())
        return InferenceEngine(model, eos_id=None, max_seq_len=32, kv_cache_bytes=1 << 16, block_size=4,
                               max_batch_tokens=8, max_num_seqs=4, attention="torch", compiled=compiled,
                               decode_steps=steps)

    reference = build_model(cfg, init=True, fused=True)
    want = engine(False).generate(prompts, params)
    counters = torch._dynamo.utils.counters
    counters.clear()
    eng = engine(True)
    assert eng.onednn_linears == 0 and all(is_compiled(layer) for layer in eng.model.model.layers)
    for steps in (1, 4):
        eng.decode_steps = steps
        got = eng.generate(prompts, params)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        if steps == 1:  # prefill chunks, decode steps of 1 to 4 rows and mixed steps: every kind compiled now
            graphs = counters["stats"]["unique_graphs"]
            assert graphs > 0
    assert counters["stats"]["unique_graphs"] == graphs  # the second generate compiled nothing
