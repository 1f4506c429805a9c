"""ShardedMuon against torch.optim.Muon, and QK-Clip against attention logits computed by hand.

The distributed cases run 2 spawned processes (gloo, FSDP2 ``fully_shard``) once per session and
compare their gathered weights with the same computation done in one process on full tensors.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch import nn

from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.native.attention import Attention, positions_from_valid
from engines.model.native.causal_lm import CausalLM, track_max_logits
from engines.model.native.document_mask import DocumentMask
from engines.model.sharded import chunk_rows
from engines.training.muon import ShardedMuon, assign_owners
from engines.training.optim import build_optimizers
from engines.training.qk_clip import qk_clip
from tests.conftest import tiny_config
from tests.ranks import rank_body, run_ranks

MUON_SHAPES = [(37, 16), (24, 37), (1, 24), (37, 16), (16, 16)]  # odd rows, a 1-row matrix, a repeated shape
MUON_STEPS = 4
MUON_HP = dict(lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
CLIP_TAU = 16.0  # splits the 2-layer models' heads into clipped and untouched ones
# hidden 24: with 3 heads of 8 rows, head 1 straddles the two FSDP shards of q_proj (and of k_proj for MHA)
CLIP_CONFIGS = {"mha": dict(num_attention_heads=3, num_key_value_heads=3),
                "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
                "mqa": dict(num_attention_heads=3, num_key_value_heads=1)}


# torch.optim.Muon is the reference: ShardedMuon runs torch's bfloat16 kernels too (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("torch_muon_kernels")


# ---------------------------------------------------------------------------------------------- helpers
def muon_grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in MUON_SHAPES]


def muon_model() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Linear(i, o, bias=False) for o, i in MUON_SHAPES)


def clip_model(kind: str, layers: int = 2) -> CausalLM:
    torch.manual_seed(1)
    model = CausalLM(tiny_config(64, hidden_size=24, intermediate_size=40, num_hidden_layers=layers,
                                 **CLIP_CONFIGS[kind]))
    with torch.no_grad():  # weights large enough that attention logits spread over tens
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.5)
    return model


def clip_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 64, (4, 12), generator=g)
    valid = torch.arange(12)[None, :] < torch.tensor([12, 7, 4, 12])[:, None]  # rows 1 and 2 right-padded
    return ids.masked_fill(~valid, 0), valid


def forward(model: CausalLM, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The trainer's forward of a right-padded batch: each row one document, padding as filler."""
    with torch.no_grad():
        return model(ids, positions_from_valid(valid), DocumentMask.from_padded(valid))


def attentions(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


@torch.no_grad()
def reference_max_logits(model: CausalLM, ids: torch.Tensor, valid: torch.Tensor,
                         all_pairs: bool = False) -> list[torch.Tensor]:
    """Per layer, per head max of q·kᵀ/√d written out from the weights in float64: own RoPE, and the pairs
    enumerated by loops — in each row, every real token i and every real token j ≤ i (``all_pairs``: every
    real j, later ones included); padding is never a query nor a key."""
    inputs = []  # each attention layer's input, the one thing taken from the model's own forward
    hooks = [a.register_forward_hook(lambda m, args, out: inputs.append(args[0])) for a in attentions(model)]
    forward(model, ids, valid)
    [h.remove() for h in hooks]
    cfg = model.config
    d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)

    def rope(x, pos):  # x [d] at position pos, rotate pairs (i, i + d/2)
        ang = pos * inv
        x1, x2 = x[: d // 2], x[d // 2:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()])

    out = []
    for x, attn in zip(inputs, attentions(model), strict=True):
        x = x.double()
        q, k = x @ attn.q_proj.weight.double().T, x @ attn.k_proj.weight.double().T
        best = torch.full((nh,), -math.inf, dtype=torch.float64)
        for b in range(ids.shape[0]):
            n = int(valid[b].sum())  # right-padded: the real tokens are the first n
            for h in range(nh):
                kv = h // (nh // nkv)
                for i in range(n):
                    qi = rope(q[b, i, h * d:(h + 1) * d], i)
                    for j in range(n if all_pairs else i + 1):
                        s = float(qi @ rope(k[b, j, kv * d:(kv + 1) * d], j)) / math.sqrt(d)
                        best[h] = max(best[h], s)
        out.append(best.float())
    return out


# ------------------------------------------------------------------------------------ Muon, one process
@pytest.mark.parametrize("nesterov,adjust,batch_bytes",  # batch_bytes 1: one matrix per Newton–Schulz batch
                         [(True, "match_rms_adamw", 1 << 28), (False, "original", 1 << 28), (True, None, 1)])
def test_sharded_muon_equals_torch_muon_on_plain_tensors(nesterov, adjust, batch_bytes):
    a, b = muon_model(), muon_model()
    ref = torch.optim.Muon(a.parameters(), lr=0.05, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust)
    ours = ShardedMuon(b.parameters(), lr=0.05, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust,
                       max_batch_bytes=batch_bytes)
    start = [p.detach().clone() for p in a.parameters()]
    for step in range(MUON_STEPS):
        for pa, pb, g in zip(a.parameters(), b.parameters(), muon_grads(step), strict=True):
            pa.grad, pb.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    for p0, pa, pb in zip(start, a.parameters(), b.parameters(), strict=True):
        assert (pa - p0).abs().max() > 1e-2  # the steps moved the weights
        torch.testing.assert_close(pb, pa, atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.state[pb]["momentum_buffer"], ref.state[pa]["momentum_buffer"],
                                   atol=1e-6, rtol=0)


def test_sharded_muon_state_dict_round_trips_and_matches_torch_format():
    a, b, c = muon_model(), muon_model(), muon_model()
    opt = ShardedMuon(a.parameters(), **MUON_HP)
    for step in range(2):
        for p, g in zip(a.parameters(), muon_grads(step), strict=True):
            p.grad = g
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    with torch.no_grad():
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            pb.copy_(pa)
        c.load_state_dict(b.state_dict())
    resumed = ShardedMuon(b.parameters(), **MUON_HP)
    resumed.load_state_dict(copy.deepcopy(saved))  # loading keeps the given tensors: one copy per optimizer
    assert resumed.state_dict()["param_groups"] == saved["param_groups"]
    # the state is torch.optim.Muon's, so torch's optimizer resumes from it as well
    torch_resumed = torch.optim.Muon(c.parameters(), **MUON_HP)
    torch_resumed.load_state_dict(saved)
    for m in (a, b, c):
        for p, g in zip(m.parameters(), muon_grads(2), strict=True):
            p.grad = g.clone()
    for o in (opt, resumed, torch_resumed):
        o.step()
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb)
        torch.testing.assert_close(pc, pa, atol=1e-6, rtol=0)


def test_build_optimizers_uses_sharded_muon_on_hidden_matrices(tiny_model):
    muon, adamw = build_optimizers(tiny_model, "muon", 1e-3, 0.0)
    assert isinstance(muon, ShardedMuon) and isinstance(adamw, torch.optim.AdamW)
    assert muon.defaults["adjust_lr_fn"] == "match_rms_adamw"
    (only,) = build_optimizers(tiny_model, "adamw", 1e-3, 0.0)
    assert isinstance(only, torch.optim.AdamW)
    with pytest.raises(ValueError, match="unknown optimizer kind"):
        build_optimizers(tiny_model, "sgd", 1e-3, 0.0)


def test_shard_rows_follow_torch_chunk_and_owners_balance():
    for rows in (1, 2, 5, 37, 64):
        for world in (1, 2, 3, 4):
            chunks = [len(c) for c in torch.arange(rows).chunk(world)]
            assert chunk_rows(rows, world) == chunks + [0] * (world - len(chunks))
    owners = assign_owners([5.0, 4.0, 3.0, 3.0, 3.0], 2)
    assert owners == [0, 1, 1, 0, 1]  # largest first to the least loaded rank: loads 8 and 10
    assert assign_owners([1.0] * 4, 3) == [0, 1, 2, 0]


# ----------------------------------------------------------------------------- QK-Clip, one process
@pytest.mark.parametrize("kind", list(CLIP_CONFIGS))
def test_tracked_max_logits_equal_hand_computed_logits_with_padding(kind):
    model = clip_model(kind)
    ids, valid = clip_batch()
    ref_first = reference_max_logits(model, ids[:2], valid[:2])
    ref_all = reference_max_logits(model, ids, valid)
    track_max_logits(model)
    forward(model, ids[:2], valid[:2])
    for attn, ref in zip(attentions(model), ref_first, strict=True):
        torch.testing.assert_close(attn.max_logits, ref, atol=1e-4, rtol=1e-5)
    forward(model, ids[2:], valid[2:])  # a second call folds into the running max
    for attn, ref in zip(attentions(model), ref_all, strict=True):
        torch.testing.assert_close(attn.max_logits, ref, atol=1e-4, rtol=1e-5)
    # the mask matters here: with every pair allowed, some head's max would be larger
    free = reference_max_logits(model, ids, valid, all_pairs=True)
    assert any((f > r + 1e-3).any() for f, r in zip(free, ref_all, strict=True))


@pytest.mark.parametrize("kind", list(CLIP_CONFIGS))
def test_qk_clip_rescales_only_offending_heads_to_tau(kind):
    model = clip_model(kind, layers=1)  # one layer: clipping cannot change its own input
    ids, valid = clip_batch()
    (s_ref,) = reference_max_logits(model, ids, valid)
    tau = float(s_ref.max() + s_ref.min()) / 2
    over = s_ref > tau
    assert over.any() and not over.all(), s_ref  # the case exercises both branches
    attn = attentions(model)[0]
    wq, wk = attn.q_proj.weight.detach().clone(), attn.k_proj.weight.detach().clone()
    track_max_logits(model)
    forward(model, ids, valid)
    metrics = qk_clip(model, tau)
    assert attn.max_logits is None
    assert metrics["qk_clipped_heads"] == int(over.sum())
    assert metrics["max_logit_layer0"] == pytest.approx(float(s_ref.max()), rel=1e-5)
    assert metrics["max_logit"] == metrics["max_logit_layer0"]

    d, mha = model.config.head_dim, kind == "mha"
    for h in range(model.config.num_attention_heads):
        rows = slice(h * d, (h + 1) * d)
        gamma = tau / float(s_ref[h])
        pairs = [(attn.q_proj.weight, wq, math.sqrt(gamma) if mha else gamma)]
        if mha:  # MHA splits gamma between W_q and W_k of the head
            pairs.append((attn.k_proj.weight, wk, math.sqrt(gamma)))
        for w, w0, scale in pairs:
            if over[h]:
                torch.testing.assert_close(w[rows], w0[rows] * scale)
            else:
                assert torch.equal(w[rows], w0[rows])
    if not mha:
        assert torch.equal(attn.k_proj.weight, wk)  # a key shared by query heads is never scaled

    # the same inputs again: clipped heads land on tau, the others keep their logits
    forward(model, ids, valid)
    after = attn.max_logits
    assert (after[over] <= tau * (1 + 1e-4)).all() and (after[over] >= tau * (1 - 1e-4)).all()
    torch.testing.assert_close(after[~over], s_ref[~over], atol=1e-4, rtol=1e-5)
    (s_new,) = reference_max_logits(model, ids, valid)
    torch.testing.assert_close(after, s_new, atol=1e-4, rtol=1e-5)


def test_qk_clip_without_tau_only_reports():
    model = clip_model("gqa")
    ids, valid = clip_batch()
    before = copy.deepcopy(model.state_dict())
    assert qk_clip(model, None) == {"qk_clipped_heads": 0.0}  # nothing tracked yet
    track_max_logits(model)
    forward(model, ids, valid)
    ref = reference_max_logits(model, ids, valid)
    metrics = qk_clip(model, None)
    assert metrics["qk_clipped_heads"] == 0
    for i, r in enumerate(ref):
        assert metrics[f"max_logit_layer{i}"] == pytest.approx(float(r.max()), rel=1e-5)
    assert metrics["max_logit"] == pytest.approx(max(float(r.max()) for r in ref), rel=1e-5)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    with pytest.raises(ValueError, match="tau"):
        qk_clip(model, 0.0)


def test_tracking_leaves_state_dict_alone_and_skips_the_inference_path():
    model = clip_model("gqa")
    keys = list(model.state_dict())
    track_max_logits(model)
    engine = InferenceEngine(model, eos_id=None, pad_id=0, max_seq_len=64, kv_cache_bytes=1 << 20, seed=0)
    outs = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(1.0, 4))
    assert all(len(o.token_ids) == 4 for o in outs)
    assert all(a.max_logits is None for a in attentions(model))
    ids, valid = clip_batch()
    forward(model, ids, valid)
    assert all(a.max_logits is not None and a.max_logits.shape == (4,) for a in attentions(model))
    assert list(model.state_dict()) == keys


# ----------------------------------------------------------------------- 2 processes, FSDP2 and gloo
def _muon_dist(mesh) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    model = muon_model()
    for m in model:  # the ModuleList itself has no parameters (nor a forward) to shard
        fully_shard(m, mesh=mesh)
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    opt = ShardedMuon(params, **MUON_HP)

    def set_grads(step):
        for p, g in zip(params, muon_grads(step), strict=True):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])

    for step in range(MUON_STEPS - 1):
        set_grads(step)
        opt.step()
    after = [p.detach().full_tensor() for p in params]
    local_rows = [p.to_local().shape[0] for p in params]
    buf_rows = [opt.state[p]["momentum_buffer"].to_local().shape[0] for p in params]
    saved = copy.deepcopy(opt.state_dict())
    set_grads(MUON_STEPS - 1)
    opt.step()
    last = [p.detach().full_tensor() for p in params]
    # resume: restore the weights, load the saved state into a fresh optimizer, take the same step
    with torch.no_grad():
        for p, w in zip(params, after, strict=True):
            p.to_local().copy_(distribute_tensor(w, mesh, [Shard(0)]).to_local())
    resumed = ShardedMuon(params, **MUON_HP)
    resumed.load_state_dict(saved)
    set_grads(MUON_STEPS - 1)
    resumed.step()
    # a layout it cannot orthogonalise whole is refused by name, not silently stepped per shard
    odd = nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)]))
    odd.grad = distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)])
    try:
        ShardedMuon([odd]).step()
        refused = ""
    except NotImplementedError as e:
        refused = str(e)
    return {"after": after, "last": last, "resumed": [p.detach().full_tensor() for p in params],
            "local_rows": local_rows, "buf_rows": buf_rows, "refused": refused}


def _clip_dist(mesh, rank: int, kind: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = clip_model(kind)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids, valid = clip_batch()
    mine = slice(2 * rank, 2 * rank + 2)
    track_max_logits(model)
    forward(model, ids[mine], valid[mine])
    local = [a.max_logits.clone() for a in attentions(model)]
    metrics = qk_clip(model, CLIP_TAU)
    track_max_logits(model, False)
    weights = {n: p.detach().full_tensor() for n, p in model.named_parameters() if "q_proj" in n or "k_proj" in n}
    return {"local": local, "metrics": metrics, "weights": weights, "out": forward(model, ids[mine], valid[mine])}


def _dist_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    with rank_body(rank, out_dir):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        res = {"muon": _muon_dist(mesh), **{kind: _clip_dist(mesh, rank, kind) for kind in CLIP_CONFIGS}}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory) -> list[dict]:
    return run_ranks(_dist_worker, tmp_path_factory.mktemp("dist"))


def test_fsdp2_sharded_muon_equals_single_process_muon(dist_results):
    model = muon_model()
    ref = torch.optim.Muon(model.parameters(), **MUON_HP)
    snapshots = []
    for step in range(MUON_STEPS):
        for p, g in zip(model.parameters(), muon_grads(step), strict=True):
            p.grad = g
        ref.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    for res in (r["muon"] for r in dist_results):
        for ours, want in zip(res["after"], snapshots[MUON_STEPS - 2], strict=True):
            torch.testing.assert_close(ours, want, atol=1e-6, rtol=0)
        for ours, resumed, want in zip(res["last"], res["resumed"], snapshots[-1], strict=True):
            torch.testing.assert_close(ours, want, atol=1e-6, rtol=0)
            assert torch.equal(resumed, ours)  # state_dict round trip resumes the same step
        assert res["buf_rows"] == res["local_rows"]  # momentum is sharded like the parameter
    assert [r["muon"]["local_rows"] for r in dist_results] == [[19, 12, 1, 19, 8], [18, 12, 0, 18, 8]]
    assert all("Shard(0)" in r["muon"]["refused"] for r in dist_results)


@pytest.mark.parametrize("kind", list(CLIP_CONFIGS))
def test_fsdp2_qk_clip_equals_single_process_on_the_whole_batch(dist_results, kind):
    model = clip_model(kind)
    ids, valid = clip_batch()
    track_max_logits(model)
    forward(model, ids, valid)
    global_max = [a.max_logits.clone() for a in attentions(model)]
    metrics = qk_clip(model, CLIP_TAU)
    assert 0 < metrics["qk_clipped_heads"] < sum(len(s) for s in global_max)
    # each rank alone saw a smaller max somewhere, so the all-reduce matters
    assert any((loc < glob).any() for r in dist_results for loc, glob in zip(r[kind]["local"], global_max,
                                                                                strict=True))
    params = dict(model.named_parameters())
    for rank, res in enumerate(r[kind] for r in dist_results):
        assert res["metrics"] == pytest.approx(metrics, rel=1e-6)
        for name, w in res["weights"].items():
            torch.testing.assert_close(w, params[name].detach(), atol=1e-6, rtol=1e-6)
        mine = slice(2 * rank, 2 * rank + 2)
        torch.testing.assert_close(res["out"], forward(model, ids[mine], valid[mine]), atol=1e-4, rtol=1e-5)
