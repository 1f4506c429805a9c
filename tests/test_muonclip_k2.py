"""MuonClip on the Kimi K2 / DeepSeek-V3 layout: QK-Clip for multi-head latent attention and Muon
on stacked expert tensors, each against a reference written out independently of the model code.

QK-Clip for MLA (the QK-Clip write-up): per head, the head-specific q_C and k_C by √γ, the rotary
query q_R by γ, the shared rotary key k_R never; S_max on the whole (nope + rope) logit. Muon: every
expert's matrix is orthogonalised on its own, exactly as torch.optim.Muon does a lone matrix.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

from engines.model.native.arch import make_config
from engines.model.native.attention import LatentAttention, positions_from_valid
from engines.model.native.causal_lm import CausalLM, track_max_logits
from engines.model.native.document_mask import DocumentMask
from engines.model.native.moe import Router
from engines.training.muon import ShardedMuon
from engines.training.optim import build_optimizers
from engines.training.qk_clip import qk_clip
from tests.ranks import rank_body, run_ranks

TAU = 11.5  # between the heads' maxima (about 7 to 15.5): some heads clipped, some not
EXPERTS, ROWS, COLS = 5, 12, 8  # an odd expert count: the two FSDP ranks hold 3 and 2 experts
MUON_HP = dict(lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
STEPS = 3



# torch.optim.Muon is the reference: ShardedMuon runs torch's bfloat16 kernels too (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("torch_muon_kernels")


def k2_config(**kw):
    args = dict(vocab_size=64, hidden_size=24, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=3, num_key_value_heads=3, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                n_group=2, topk_group=1, first_k_dense_replace=1, rope_interleave=False,
                max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return make_config("deepseek_v3", **{**args, **kw})


def k2_model(**kw) -> CausalLM:
    torch.manual_seed(3)
    model = CausalLM(k2_config(**kw))
    with torch.no_grad():  # large enough that the attention logits spread over several τ
        for n, p in model.named_parameters():
            if p.ndim >= 2 and "embed" not in n:
                p.normal_(0, 0.6)
            elif p.ndim >= 2:
                p.normal_(0, 1.0)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (3, 10), generator=g)
    valid = torch.arange(10)[None] < torch.tensor([10, 6, 3])[:, None]
    return ids.masked_fill(~valid, 0), valid


def run(model: CausalLM, ids, valid) -> torch.Tensor:
    """The trainer's forward of a right-padded batch: each row one document, padding as filler."""
    with torch.no_grad():
        return model(ids, positions_from_valid(valid), DocumentMask.from_padded(valid))


def mla_layers(model) -> list[LatentAttention]:
    return [m for m in model.modules() if isinstance(m, LatentAttention)]


def layer_inputs(model: CausalLM, ids, valid) -> list[torch.Tensor]:
    """Each attention layer's input, the one thing the reference takes from the model's own forward."""
    inputs = []
    hooks = [a.register_forward_hook(lambda m, args, out: inputs.append(args[0])) for a in mla_layers(model)]
    run(model, ids, valid)
    [h.remove() for h in hooks]
    return inputs


@torch.no_grad()
def reference_max_logits(model: CausalLM, ids, valid, inputs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Per layer and head, max over valid pairs of scale·(q_C·k_C + rope(q_R)·rope(k_R)) in float64,
    from the weights: own RMSNorm, own RoPE (pairs i, i + d/2), the pairs enumerated by loops."""
    inputs = inputs or layer_inputs(model, ids, valid)
    cfg = model.config
    h, nope, rope_d, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0).double()
    ang = pos[..., None] / cfg.rope_theta ** (torch.arange(0, rope_d, 2, dtype=torch.float64) / rope_d)

    def rope(x):
        x1, x2 = x[..., : rope_d // 2], x[..., rope_d // 2:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w.double()

    # the pairs, by loops: in each row every real query i and real key j ≤ i (padding is neither)
    allowed = torch.zeros(ids.shape[0], ids.shape[1], ids.shape[1], dtype=torch.bool)
    for b in range(ids.shape[0]):
        for i in range(int(valid[b].sum())):
            for j in range(i + 1):
                allowed[b, i, j] = True
    scale = (nope + rope_d) ** -0.5
    out = []
    for x, a in zip(inputs, mla_layers(model), strict=True):
        x = x.double()
        if a.q_lora_rank is None:
            q = x @ a.q_proj.weight.double().T
        else:
            q = rms(x @ a.q_a_proj.weight.double().T, a.q_a_layernorm.weight) @ a.q_b_proj.weight.double().T
        ckv = x @ a.kv_a_proj_with_mqa.weight.double().T
        k_r = rope(ckv[..., cfg.kv_lora_rank:])
        kv = rms(ckv[..., :cfg.kv_lora_rank], a.kv_a_layernorm.weight) @ a.kv_b_proj.weight.double().T
        heads = []
        for i in range(h):
            qh = q[..., i * (nope + rope_d):(i + 1) * (nope + rope_d)]
            k_c = kv[..., i * (nope + vd):i * (nope + vd) + nope]
            s = (qh[..., :nope] @ k_c.transpose(1, 2) + rope(qh[..., nope:]) @ k_r.transpose(1, 2)) * scale
            heads.append(s.masked_fill(~allowed, -math.inf).amax())
        out.append(torch.stack(heads).float())
    return out


@pytest.mark.parametrize("q_lora", [12, None])
def test_mla_tracked_max_logit_is_the_whole_nope_plus_rope_logit(q_lora):
    model = k2_model(q_lora_rank=q_lora)
    ids, valid = batch()
    track_max_logits(model)
    run(model, ids, valid)
    for a, want in zip(mla_layers(model), reference_max_logits(model, ids, valid), strict=True):
        torch.testing.assert_close(a.max_logits, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("q_lora", [12, None])
def test_mla_qk_clip_scales_qc_kc_by_sqrt_gamma_qr_by_gamma_and_never_kr(q_lora):
    model = k2_model(q_lora_rank=q_lora)
    cfg, ids, valid = model.config, *batch()
    nope, rope_d, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs = layer_inputs(model, ids, valid)
    track_max_logits(model)
    run(model, ids, valid)
    s_max = [a.max_logits.clone() for a in mla_layers(model)]
    metrics = qk_clip(model, TAU)
    n_over = sum(int((s > TAU).sum()) for s in s_max)
    assert 0 < metrics["qk_clipped_heads"] == n_over < sum(len(s) for s in s_max)  # some heads, not all
    q_name = "q_b_proj" if q_lora else "q_proj"
    for li, (a, s) in enumerate(zip(mla_layers(model), s_max, strict=True)):
        q_want = before[f"model.layers.{li}.self_attn.{q_name}.weight"].clone()
        kv_want = before[f"model.layers.{li}.self_attn.kv_b_proj.weight"].clone()
        for head, v in enumerate(s.tolist()):
            if v <= TAU:
                continue
            g = TAU / v
            q0 = head * (nope + rope_d)
            q_want[q0:q0 + nope] *= math.sqrt(g)                 # q_C
            q_want[q0 + nope:q0 + nope + rope_d] *= g            # q_R
            k0 = head * (nope + vd)
            kv_want[k0:k0 + nope] *= math.sqrt(g)                # k_C; the head's v rows stay
        torch.testing.assert_close(getattr(a, q_name).weight, q_want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(a.kv_b_proj.weight, kv_want, atol=1e-6, rtol=1e-6)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.endswith((f"{q_name}.weight", "kv_b_proj.weight")) for n in changed)
    # k_R lives in kv_a_proj_with_mqa, shared by all heads: untouched (checked by `changed`). On the same
    # layer inputs every clipped head now peaks at exactly τ and every other head is unchanged
    for ref, s in zip(reference_max_logits(model, ids, valid, inputs), s_max, strict=True):
        torch.testing.assert_close(ref, s.clamp(max=TAU), atol=1e-4, rtol=1e-5)
    track_max_logits(model)
    run(model, ids, valid)  # the first layer's input is the embedding, unchanged by the clip
    torch.testing.assert_close(mla_layers(model)[0].max_logits, s_max[0].clamp(max=TAU), atol=1e-4, rtol=1e-5)


def test_optimizer_split_for_the_k2_layout():
    """Muon: attention and expert matrices in the layers (stacks whole); AdamW: router, norms, embeddings,
    head; the score-correction bias is a frozen buffer."""
    model = CausalLM(k2_config())
    muon, adamw = build_optimizers(model, "muon", 1e-3, 0.0)
    assert isinstance(muon, ShardedMuon)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[i] for i in in_muon if model.get_parameter(names[i]).ndim == 3} == {
        "model.layers.1.mlp.experts.gate_proj", "model.layers.1.mlp.experts.up_proj",
        "model.layers.1.mlp.experts.down_proj"}
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert routers and all(id(m.weight) not in in_muon for m in routers)
    assert all(id(p) not in in_muon for n, p in model.named_parameters() if "norm" in n or "embed" in n
               or n.startswith("lm_head"))
    assert len(in_muon) + sum(len(g["params"]) for g in adamw.param_groups) == len(list(model.parameters()))
    assert all("e_score_correction_bias" not in n for n, _ in model.named_parameters())
    assert any(n.endswith("e_score_correction_bias") for n, _ in model.named_buffers())


def expert_grads(step: int) -> torch.Tensor:
    return torch.randn(EXPERTS, ROWS, COLS, generator=torch.Generator().manual_seed(40 + step))


def per_expert_reference() -> list[list[torch.Tensor]]:
    """Each expert as its own matrix under torch.optim.Muon: weights after every step."""
    torch.manual_seed(0)
    stack = torch.randn(EXPERTS, ROWS, COLS)
    mats = [nn.Parameter(stack[e].clone()) for e in range(EXPERTS)]
    opt = torch.optim.Muon(mats, **MUON_HP)
    out = []
    for step in range(STEPS):
        for e, p in enumerate(mats):
            p.grad = expert_grads(step)[e].clone()
        opt.step()
        out.append([p.detach().clone() for p in mats])
    return out


def test_muon_orthogonalises_each_expert_on_its_own():
    torch.manual_seed(0)
    stack = nn.Parameter(torch.randn(EXPERTS, ROWS, COLS))
    flat = nn.Parameter(stack.detach().reshape(EXPERTS * ROWS, COLS).clone())
    opt, flat_opt = ShardedMuon([stack], **MUON_HP), torch.optim.Muon([flat], **MUON_HP)
    for step in range(STEPS):
        stack.grad, flat.grad = expert_grads(step), expert_grads(step).reshape(EXPERTS * ROWS, COLS)
        opt.step()
        flat_opt.step()
    want = torch.stack(per_expert_reference()[-1])
    torch.testing.assert_close(stack.detach(), want, atol=1e-6, rtol=0)
    # one flattened [E·n, m] matrix is a different update: the test tells the two apart
    assert (flat.detach().reshape_as(want) - want).abs().max() > 1e-3


def _dist_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    with rank_body(rank, out_dir):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        holder = nn.Module()
        holder.experts = nn.Parameter(torch.randn(EXPERTS, ROWS, COLS))
        fully_shard(holder, mesh=mesh)
        opt = ShardedMuon([holder.experts], **MUON_HP)
        for step in range(STEPS):
            holder.experts.grad = distribute_tensor(expert_grads(step), mesh, [Shard(0)])
            opt.step()
        torch.save({"local": holder.experts.to_local().shape[0], "full": holder.experts.detach().full_tensor()},
                   os.path.join(out_dir, f"rank{rank}.pt"))


def test_fsdp2_sharded_expert_stack_equals_per_expert_muon(tmp_path):
    results = run_ranks(_dist_worker, tmp_path)
    want = torch.stack(per_expert_reference()[-1])
    assert [r["local"] for r in results] == [3, 2]  # whole experts on each rank
    for r in results:
        torch.testing.assert_close(r["full"], want, atol=1e-6, rtol=0)
