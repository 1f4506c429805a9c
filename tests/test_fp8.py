"""Block-FP8 weights: the reference quantisation, FP8 replicas, and reading DeepSeek-V3/Kimi K2-style
FP8 checkpoints (F8_E4M3 matrices with float32 ``weight_scale_inv``), whole and row-sharded."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from engines.model.io.hf_io import ModelDirError, load_pretrained, read_config, save_pretrained
from engines.model.layout import hub_state
from engines.model.native.arch import make_config
from engines.model.native.causal_lm import build_model
from engines.model.native.fp8 import FP8, Fp8Experts, Fp8Linear, dequantize, quantize, quantize_with, to_fp8
from tests.ranks import rank_body, run_ranks

K2_TINY = dict(vocab_size=64, hidden_size=40, intermediate_size=72, moe_intermediate_size=24, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
               qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
               n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64, bos_token_id=None,
               eos_token_id=None, pad_token_id=None)
BLOCK = 16  # the checkpoints' 128 scaled down with the model: shapes of 24, 40, 72 rows cut blocks


def test_reference_quantisation():
    torch.manual_seed(0)
    w = torch.randn(40, 72) * torch.logspace(-3, 1, 40)[:, None]  # blocks of very different magnitudes
    w[:16, :16] = 0                                               # an all-zero block
    q, s = quantize(w, BLOCK)
    assert q.dtype == FP8 and s.shape == (3, 5) and s.dtype == torch.float32
    assert s[0, 0] == 1 and torch.equal(q[:16, :16].float(), torch.zeros(16, 16))
    assert torch.equal(s[1, 2], w[16:32, 32:48].abs().max() / 448)  # amax / 448
    assert q.float().abs().max() <= 448
    back = dequantize(q, s, BLOCK)
    # e4m3 keeps 3 mantissa bits: within 1/16 of each element, plus the block's smallest step
    assert ((back - w).abs() <= w.abs() / 16 + s.repeat_interleave(BLOCK, 0)[:40].repeat_interleave(BLOCK, 1)[:, :72]
            * 2 ** -9).all()
    # any run of whole block rows, quantised with its blocks' scales, is the same bytes
    assert torch.equal(quantize_with(w[16:40], s[1:], BLOCK).view(torch.uint8), q[16:].view(torch.uint8))


@pytest.mark.parametrize("family", ["llama", "kimi_k2"])
def test_fp8_replica_holds_the_reference_and_serves(family):
    """Fused q/k/v and gate/up (parts not aligned to blocks), stacked experts: every matrix keeps each
    checkpoint part's own block grid, so the replica's checkpoint-named tensors are the reference."""
    torch.manual_seed(0)
    cfg = make_config("kimi_k2", **K2_TINY) if family == "kimi_k2" else make_config(
        "llama", vocab_size=64, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = build_model(cfg, init=True, fused=True, dtype=torch.bfloat16)
    ref = {k: v.clone() for k, v in hub_state(model).items()}
    ids, pos = torch.randint(0, 64, (2, 6)), torch.arange(6).expand(2, 6)
    before = model(ids, pos).float()
    to_fp8(model, BLOCK).to(torch.bfloat16)  # moving it must not cast FP8 bytes or float32 scales
    hub = hub_state(model)
    quantised = [k for k in ref if k + "_scale_inv" in hub]
    assert any(".experts." in k for k in quantised) == (family == "kimi_k2") and "lm_head.weight" not in quantised
    for k, w in ref.items():
        if k in quantised:
            q, s = quantize(w, BLOCK)
            assert torch.equal(hub[k].view(torch.uint8), q.view(torch.uint8)), k
            assert torch.equal(hub[k + "_scale_inv"], s), k
        else:
            assert torch.equal(hub[k], w), k
    after = model(ids, pos).float()
    assert (after - before).abs().max() < 0.1 * before.abs().max()  # FP8 weights, close logits


class _Float32Outputs(TorchDispatchMode):
    """Records the size of every float32 tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.sizes.append(out.numel())
        return out


def test_a_replica_dequantises_straight_to_its_compute_dtype():
    """Every forward of a bf16 FP8 replica dequantises its matrices: in bf16 (which holds each e4m3 value
    exactly) that is within a bf16 step of the float32 reference, and no float32 matrix is ever made
    (it used to be: about 6x the traffic of the bf16 weights)."""
    torch.manual_seed(0)
    model = to_fp8(build_model(make_config("kimi_k2", **K2_TINY), init=True, fused=True, dtype=torch.bfloat16), BLOCK)
    mats = []  # (dequantise in a dtype, name, Q, each row's block scales)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            mats.append((m.dequantized, "weight", m.weight, m.weight_scale_inv[m._scale_row]))
        elif isinstance(m, Fp8Experts):
            mats += [(lambda dtype, m=m, n=n: m.matrix(n, 0, dtype), n, getattr(m, n)[0],
                      getattr(m, n + "_scale_inv")[0][getattr(m, f"_scale_row_{n}")])
                     for n in m._buffers if not n.endswith("_scale_inv") and not n.startswith("_")]
    assert any(q.shape[1] % BLOCK for _, _, q, _ in mats) and any(q.shape[1] % BLOCK == 0 for _, _, q, _ in mats)
    for dequantised, name, q, row_scales in mats:
        want = q.float() * row_scales.repeat_interleave(BLOCK, 1)[:, :q.shape[1]]  # per element, in float32
        with _Float32Outputs() as seen:
            got = dequantised(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and max(seen.sizes, default=0) < q.numel(), (name, seen.sizes)
        assert ((got.float() - want).abs() <= want.abs() * 2 ** -7).all(), name  # within a bf16 step
        assert torch.equal(dequantised(torch.float32), want), name


def _fp8_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Kimi K2-style checkpoint: FP8 matrices with block scales, bf16 for the rest; and the bf16 model."""
    torch.manual_seed(1)
    cfg = make_config("kimi_k2", **K2_TINY)
    model = build_model(cfg, init=True, dtype=torch.bfloat16)
    d = tmp_path / "k2-fp8"
    save_pretrained(model, None, d)
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (d / "config.json").write_text(json.dumps(raw))
    fp8 = to_fp8(copy.deepcopy(model), BLOCK)
    save_file({k: v.contiguous() for k, v in hub_state(fp8).items()}, str(d / "model.safetensors"))
    return d, {k: v.clone() for k, v in hub_state(fp8).items()}


def test_fp8_checkpoint_is_read_dequantised_or_as_stored(tmp_path):
    d, stored = _fp8_checkpoint(tmp_path)
    assert read_config(d).extra["quantization_config"]["weight_block_size"] == [BLOCK, BLOCK]
    trainer = load_pretrained(d, torch.float32)
    for k, t in hub_state(trainer).items():
        want = dequantize(stored[k], stored[k + "_scale_inv"], BLOCK) if k + "_scale_inv" in stored else stored[k]
        assert torch.equal(t, want.float()), k
    replica = load_pretrained(d, torch.bfloat16, fused=True, fp8=True)
    for k, t in hub_state(replica).items():
        assert torch.equal(t.view(torch.uint8), stored[k].view(torch.uint8)), k
    out = tmp_path / "saved"
    save_pretrained(trainer, None, out)  # written in float32: no FP8 quantization_config any more
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_other_quantisations_are_refused(tmp_path):
    d, _ = _fp8_checkpoint(tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelDirError, match=r"quantised checkpoints \(gptq\) are not supported other than block-FP8"):
        read_config(d)


def _sharded_fp8_load(rank, world, port, out_dir, model_dir):
    with rank_body(rank, out_dir):

        from engines.model import sharded
        from engines.model.io import hf_io
        from engines.training import distributed

        distributed.init_distributed(rank, world, f"tcp://127.0.0.1:{port}")
        model = build_model(read_config(model_dir), device="meta")
        model = distributed.shard_model(model, device="cpu")
        hf_io.load_weights(model, model_dir)
        full = hub_state(model, sharded.full_state_dict(model))
        torch.save({k: v.clone() for k, v in full.items()}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_row_sharded_trainer_dequantises_its_rows(tmp_path):
    """FSDP2 over 3 ranks splits 40 rows 14/14/12: shards start inside 16-row blocks."""
    d, stored = _fp8_checkpoint(tmp_path)
    for state in run_ranks(_sharded_fp8_load, tmp_path, str(d), world=3):
        for k, t in state.items():
            want = dequantize(stored[k], stored[k + "_scale_inv"], BLOCK) if k + "_scale_inv" in stored else stored[k]
            assert torch.equal(t, want.float()), k
