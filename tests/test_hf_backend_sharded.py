"""The transformers backend under FSDP2 over two ranks: decoder layers found from ``_no_split_modules``, the summed
gradients (with activation checkpointing) and a QK-Clip on row shards equal one process's."""

from __future__ import annotations

import os

import pytest
import torch

from engines.model.native.causal_lm import track_max_logits
from tests.hf_families import documents, hf_config, sharpen
from tests.ranks import rank_body, run_ranks

TAU_FRACTION = 0.6


def _model(name: str):
    from engines.model.hf.backend import build_hf_model

    torch.manual_seed(0)
    return sharpen(build_hf_model(hf_config(name, num_hidden_layers=2, **(
        {"layer_types": ["sliding_attention", "full_attention"]} if name == "gpt_oss" else {}))))


def _step(model, prompts, responses, tau: float | None):
    """Forward/backward of the documents' summed log-probs; then QK-Clip at ``tau`` (None: no clip)."""
    from engines.training.packing import pack
    from engines.training.qk_clip import qk_clip

    batch = pack(prompts, responses, 0, "sdpa", width=24)
    track_max_logits(model, True)
    lp, _ = model(batch.ids, batch.positions, batch.mask, select=batch.target_flat, targets=batch.targets)
    lp.sum().backward()
    track_max_logits(model, False)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return grads, (qk_clip(model, tau) if tau is not None else None)


def _worker(rank, world, port, out_dir, name, tau):
    with rank_body(rank, out_dir):
        from engines.model.sharded import full_state_dict
        from engines.training import distributed

        distributed.init_distributed(rank, world, f"tcp://127.0.0.1:{port}")
        model = distributed.shard_model(_model(name))
        model.activation_checkpointing = True
        prompts, responses = documents()
        grads, metrics = _step(model, prompts[rank::world], responses[rank::world], tau)
        full = {n: g.full_tensor() for n, g in grads.items() if g is not None}
        torch.save({"grads": full, "state": full_state_dict(model), "metrics": metrics,
                    "sharded_layers": sum(1 for layer in model.layers if hasattr(layer, "reshard"))},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("name", ["phi3"])  # MHA: q and k rows of the fused matrix on different ranks
def test_two_fsdp_ranks_give_one_processs_gradients_and_qk_clip(name, tmp_path):
    prompts, responses = documents()
    model = _model(name)
    rules = model.qk_clip_rules
    _step(model, prompts, responses, None)  # only for the maxima: τ below the largest
    model.zero_grad(set_to_none=True)
    top = max(float(m.max_logits.max()) for m in model.attention_modules())
    for m in model.attention_modules():
        m.max_logits = None
    tau = TAU_FRACTION * top
    grads, metrics = _step(model, prompts, responses, tau)
    want = {n: g.clone() for n, g in grads.items() if g is not None}
    results = run_ranks(_worker, tmp_path, name, tau)
    for res in results:
        assert res["sharded_layers"] == 2
        assert res["grads"].keys() == want.keys()
        for n, g in want.items():
            torch.testing.assert_close(res["grads"][n], g, atol=2e-5, rtol=1e-5, msg=n)
        assert res["metrics"]["qk_clipped_heads"] == metrics["qk_clipped_heads"]
        for n, v in model.state_dict().items():
            torch.testing.assert_close(res["state"][n], v, atol=1e-6, rtol=1e-6, msg=n)
    assert (metrics["qk_clipped_heads"] > 0) == any(r.applies for r in rules)
