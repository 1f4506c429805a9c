"""The training engine: per-row temperatures, the clipped step, FSDP2 sharding and offload/onload.

Sharded checks run two gloo ranks once per module (spawned processes that save what they saw);
every assertion compares against a single process computing the same thing on the whole batch,
one sequence at a time, without padding.
"""

from __future__ import annotations

import io
import math
import random
import socket
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engines.model.native.attention import padded_causal_mask, positions_from_valid
from engines.model.native.causal_lm import CausalLM, attention_layers, track_max_logits
from engines.model.sharded import full_state_dict, local_shards, local_tensor
from engines.training.distributed import init_distributed, rank, shard_model, world_size
from engines.training.engine import TrainingEngine
from tests.conftest import sharp_model, tiny_config
from tests.ranks import rank_body, run_ranks

VOCAB = 37  # odd: the embedding and the head split unevenly over 2 ranks (19 + 18 rows)
PAD, LR, WD = 0, 1e-2, 0.1
# (rows, micro-batch) per rank: rank 0 runs 3 passes while rank 1 runs 1 and pads 2; then 1 + pad vs 2
SPLITS = [(((0, 5), 2), ((5, 8), 3)), (((0, 1), 1), ((1, 8), 4))]
CLIP = 0.05  # well below the first step's gradient norm, so clipping acts


def _model(seed: int = 0) -> CausalLM:
    return sharp_model(tiny_config(VOCAB), seed)


def _batch(n: int = 8, seed: int = 1):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    responses = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    return prompts, responses


def _reference_logprobs(model, prompt, response, temperature):
    """log π(response token | prefix) of one sequence, without padding."""
    ids = torch.tensor([prompt + response])
    valid = torch.ones_like(ids, dtype=torch.bool)
    logits = model(ids, positions_from_valid(valid), padded_causal_mask(valid))[0].float()
    logp = F.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return torch.stack([logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(response)])


def _reference_nll(model, prompts, responses):
    n = sum(len(r) for r in responses)
    return -sum(_reference_logprobs(model, p, r, 1.0).sum() for p, r in zip(prompts, responses, strict=True)) / n


def _optimizers(model, kind: str) -> list[torch.optim.Optimizer]:
    """AdamW for everything, torch's Muon on the layers' matrices + AdamW (state: momentum and moments),
    or plain SGD with lr 1, whose step is exactly the (clipped) gradient."""
    if kind == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=1.0)]
    named = list(model.named_parameters())
    hidden = [p for n, p in named if kind == "muon" and p.ndim == 2 and ".layers." in n]
    rest = [p for n, p in named if not any(p is h for h in hidden)]
    opts = [torch.optim.Muon(hidden, lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw")] if hidden else []
    return [*opts, torch.optim.AdamW(rest, lr=LR, weight_decay=WD)]


def _engine(model, kind: str = "adamw", max_grad_norm: float = 1e9) -> TrainingEngine:
    return TrainingEngine(model, _optimizers(model, kind), PAD, max_grad_norm)


def _accumulate(engine, prompts, responses, rows, micro, passes, n_tokens) -> float:
    """Backward the global token-mean NLL of rows [lo, hi) in micro-batches; pad to ``passes``."""
    (lo, hi), total, done = rows, 0.0, 0
    for s in range(lo, hi, micro):
        lp, _ = engine.response_logprobs(prompts[s : min(s + micro, hi)], responses[s : min(s + micro, hi)], 1.0)
        loss = -lp.sum() / n_tokens
        loss.backward()
        total, done = total + float(loss.detach()), done + 1
    for _ in range(passes - done):
        engine.dummy_backward()
    return total


def _passes(split) -> int:
    return max(math.ceil((hi - lo) / micro) for (lo, hi), micro in split)


def _snapshot(engine) -> dict[str, torch.Tensor]:
    """Local copies of every parameter and optimizer-state tensor, keyed by parameter name."""
    names = {id(p): n for n, p in engine.model.named_parameters()}
    out = {f"param/{n}": local_tensor(p).detach().clone() for n, p in engine.model.named_parameters()}
    for i, opt in enumerate(engine.optimizers):
        for p, st in opt.state.items():
            out.update({f"opt{i}/{names[id(p)]}/{k}": local_tensor(v).clone() for k, v in st.items()})
    return out


def _storage_bytes(engine) -> list[int]:
    ts = [local_tensor(p) for p in engine.model.parameters()]
    ts += [local_tensor(v) for opt in engine.optimizers for st in opt.state.values() for v in st.values()]
    return [t.untyped_storage().nbytes() for t in ts]


def _train(engine, steps: int, offload: bool, world: int = 1, me: int = 0) -> dict:
    """``steps`` steps (this rank's rows: me::world); with ``offload``, offload+onload after each.

    Records what the first offload cycle looked like.
    """
    seen = {}
    for s in range(steps):
        prompts, responses = _batch(8, seed=10 + s)
        n = sum(len(r) for r in responses)
        lp, _ = engine.response_logprobs(prompts[me::world], responses[me::world], 1.0)
        (-lp.sum() / n).backward()
        engine.step()
        if offload:
            before = _snapshot(engine) if s == 0 else None
            stats = engine.offload()
            if s == 0:
                seen = {"before": before, "stats": stats, "offloaded": engine.offloaded,
                        "sizes": _storage_bytes(engine),
                        "host": {k: (v.clone(), off, v.is_pinned()) for k, (v, off) in engine.host_shards().items()}}
            engine.onload()
            if s == 0:
                seen["after"] = _snapshot(engine)
    seen["final"] = {k: v for k, v in _snapshot(engine).items() if k.startswith("param/")}
    return seen


# ---- the 2-rank run ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_rank_checks(me: int, world: int) -> dict:
    res: dict = {}
    prompts, responses = _batch()
    n_tokens = sum(len(r) for r in responses)
    for si, split in enumerate(SPLITS):
        for kind, clip in [("adamw", 1e9), ("sgd", CLIP)][: 2 if si == 0 else 1]:
            engine = _engine(shard_model(_model()), kind, clip)
            loss = _accumulate(engine, prompts, responses, *split[me], _passes(split), n_tokens)
            grads = {n: p.grad.full_tensor() for n, p in engine.model.named_parameters()}
            norm = engine.step()
            res[(si, clip)] = {"loss": loss, "grads": grads, "norm": norm,
                                     "weights": full_state_dict(engine.model)}

    model = shard_model(_model())
    model.activation_checkpointing = True  # FSDP2 gathers each layer again for its recompute
    engine = _engine(model)
    _accumulate(engine, prompts, responses, *SPLITS[0][me], _passes(SPLITS[0]), n_tokens)
    res["checkpointed"] = {n: p.grad.full_tensor() for n, p in engine.model.named_parameters()}

    engine = _engine(shard_model(_model()))
    track_max_logits(engine.model)
    with torch.no_grad():  # no-grad forwards are collective too: rank 1 pads with dummy_forward
        if me == 0:
            engine.response_logprobs(prompts[:2], responses[:2], 1.0)
        else:
            engine.dummy_forward()
    engine.dummy_backward()  # from no gradient at all: zeros
    res["dummy_from_none"] = {n: p.grad.to_local().clone() for n, p in engine.model.named_parameters()}
    # padding passes are no queries of QK-Clip's max logit: rank 1 saw nothing
    res["dummy_tracked"] = [a.max_logits for a in attention_layers(engine.model)]
    track_max_logits(engine.model, False)
    _accumulate(engine, prompts, responses, *SPLITS[0][me], _passes(SPLITS[0]), n_tokens)
    before = {n: p.grad.to_local().clone() for n, p in engine.model.named_parameters()}
    engine.dummy_backward()
    res["dummy"] = (before, {n: p.grad.to_local().clone() for n, p in engine.model.named_parameters()})

    engine = _engine(shard_model(_model(), param_dtype="bfloat16"))
    loss = _accumulate(engine, prompts, responses, *SPLITS[0][me], _passes(SPLITS[0]), n_tokens)
    grads = {n: p.grad.full_tensor() for n, p in engine.model.named_parameters()}
    engine.step()
    res["bf16"] = {"loss": loss, "grads": grads, "weights": full_state_dict(engine.model),
                   "dtypes": {n: local_tensor(p).dtype for n, p in engine.model.named_parameters()}}

    model = shard_model(_model())
    res["shards"] = {n: (t.clone(), off) for n, (t, off) in local_shards(model).items()}
    res["full"] = full_state_dict(model)
    torch.manual_seed(3)
    odd = nn.Sequential(nn.Linear(3, 1), nn.Linear(1, 5))  # (1, 3): rank 1 holds 0 rows; (5,): 3 + 2
    res["odd_ref"] = {k: v.clone() for k, v in odd.state_dict().items()}
    torch.distributed.fsdp.fully_shard(odd)
    res["odd_shards"] = {n: (t.clone(), off) for n, (t, off) in local_shards(odd).items()}

    res["offload"] = _train(_engine(shard_model(_model()), "muon"), 3, True, world, me)
    res["plain"] = _train(_engine(shard_model(_model()), "muon"), 3, False, world, me)

    # resume: step 1, save this rank's optimizer state, restore it into a fresh engine, step 2
    full = _engine(shard_model(_model()), "muon")
    _train(full, 2, False, world, me)
    first = _engine(shard_model(_model()), "muon")
    _train(first, 1, False, world, me)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    resumed = _engine(shard_model(_model()), "muon")
    with torch.no_grad():
        for p, q in zip(resumed.model.parameters(), first.model.parameters(), strict=True):
            local_tensor(p).copy_(local_tensor(q))
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    prompts2, responses2 = _batch(8, seed=11)  # _train's second step
    lp, _ = resumed.response_logprobs(prompts2[me::world], responses2[me::world], 1.0)
    (-lp.sum() / sum(len(r) for r in responses2)).backward()
    resumed.step()
    res["resume"] = (full_state_dict(full.model), full_state_dict(resumed.model))
    return res


def _rank_main(me: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    with rank_body(me, out):
        init_distributed(me, world, f"tcp://127.0.0.1:{port}", timeout_s=90)
        res = _two_rank_checks(me, world)
        res["world_rank"] = (world_size(), rank())
        torch.save(res, Path(out) / f"rank{me}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_rank_main, tmp_path_factory.mktemp("fsdp"))


@cache
def _reference(kind: str, clip: float):
    """Single process, whole batch, one sequence at a time: loss, grads, pre-clip norm, weights after the step."""
    model = _model()
    opts = _optimizers(model, kind)
    loss = _reference_nll(model, *_batch())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    with torch.no_grad():
        for p in model.parameters():
            p.grad.mul_(min(1.0, clip / (norm + 1e-6)))
    for o in opts:
        o.step()
    return float(loss.detach()), grads, norm, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("split", range(len(SPLITS)))
def test_sharded_gradients_and_adamw_step_match_one_process(ranks, split):
    loss, grads, norm, weights = _reference("adamw", 1e9)
    r0, r1 = (r[(split, 1e9)] for r in ranks)
    assert r0["loss"] + r1["loss"] == pytest.approx(loss, rel=1e-5)
    for n, g in grads.items():
        torch.testing.assert_close(r0["grads"][n], g, atol=1e-6, rtol=1e-5, msg=n)
        assert torch.equal(r0["grads"][n], r1["grads"][n])
    for n, w in weights.items():
        torch.testing.assert_close(r0["weights"][n], w, atol=1e-6, rtol=1e-5, msg=n)
    assert r0["norm"] == r1["norm"] == pytest.approx(norm, rel=1e-5)


def test_sharded_global_grad_norm_and_clipping(ranks):
    _, _, norm, weights = _reference("sgd", CLIP)
    assert norm > 2 * CLIP
    r0, r1 = (r[(0, CLIP)] for r in ranks)
    assert r0["norm"] == r1["norm"] == pytest.approx(norm, rel=1e-5)
    unclipped = _reference("sgd", 1e9)[3]
    for n, w in weights.items():
        torch.testing.assert_close(r0["weights"][n], w, atol=1e-6, rtol=1e-5, msg=n)
    for n in weights:
        assert not torch.allclose(r0["weights"][n], unclipped[n], atol=1e-4), n


def test_activation_checkpointing_under_fsdp_gives_the_same_gradients(ranks):
    _, grads, _, _ = _reference("adamw", 1e9)
    for r in ranks:
        for n, g in grads.items():
            torch.testing.assert_close(r["checkpointed"][n], g, atol=1e-6, rtol=1e-5, msg=n)


def test_padding_passes_do_not_count_in_the_max_logit(ranks):
    """Rank 1 only ran dummy passes (two filler tokens each); they once counted as attention logits."""
    assert all(m is not None and torch.isfinite(m).all() for m in ranks[0]["dummy_tracked"])
    assert all(m is None or (m == float("-inf")).all() for m in ranks[1]["dummy_tracked"])


def test_dummy_backward_adds_exactly_zero(ranks):
    for r in ranks:
        assert all(not g.any() for g in r["dummy_from_none"].values())
        before, after = r["dummy"]
        assert any(g.any() for g in before.values())
        for n in before:
            assert torch.equal(before[n], after[n]), n


def test_bf16_compute_keeps_float32_master_weights(ranks):
    loss, grads, _, _ = _reference("adamw", 1e9)
    r0, r1 = (r["bf16"] for r in ranks)
    assert math.isfinite(r0["loss"] + r1["loss"])
    assert r0["loss"] + r1["loss"] == pytest.approx(loss, rel=2e-2)
    assert set(r0["dtypes"].values()) == {torch.float32}
    for n, g in grads.items():
        assert r0["grads"][n].dtype == torch.float32
        assert float((r0["grads"][n] - g).norm() / g.norm()) < 0.05, n
    before = _model().state_dict()
    for n, w in r0["weights"].items():
        assert w.dtype == torch.float32 and torch.isfinite(w).all() and not torch.equal(w, before[n]), n


def _reassemble(per_rank: list[dict], name: str, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(like.numel() * like.element_size(), dtype=torch.uint8)
    covered = 0
    for shards in per_rank:
        t, off = shards[name]
        raw = t.contiguous().view(-1).view(torch.uint8)
        out[off : off + raw.numel()] = raw
        covered += raw.numel()
    assert covered == out.numel(), name  # the ranks' ranges are disjoint and cover the tensor
    return out.view(like.dtype).view(like.shape)


def test_local_shards_reassemble_the_full_tensors(ranks):
    ref = _model().state_dict()
    assert ranks[0]["shards"]["model.embed_tokens.weight"][0].shape[0] == 19
    assert ranks[1]["shards"]["model.embed_tokens.weight"][0].shape[0] == 18
    assert ranks[1]["odd_shards"]["0.weight"][0].shape[0] == 0
    for n, v in ref.items():
        assert torch.equal(_reassemble([r["shards"] for r in ranks], n, v), v), n
        assert torch.equal(ranks[0]["full"][n], v), n
    for n, v in ranks[0]["odd_ref"].items():
        assert torch.equal(_reassemble([r["odd_shards"] for r in ranks], n, v), v), n
    assert [r["world_rank"] for r in ranks] == [(2, 0), (2, 1)]


def _check_offload_cycle(seen: dict, plain_final: dict) -> None:
    assert seen["offloaded"] and seen["stats"]["bytes"] > 0
    assert seen["sizes"] and all(s == 0 for s in seen["sizes"])
    assert any("exp_avg" in k for k in seen["before"]) and any("momentum_buffer" in k for k in seen["before"])
    for name, (host, _, _) in seen["host"].items():
        assert torch.equal(host, seen["before"][f"param/{name}"]), name
    assert seen["before"].keys() == seen["after"].keys()
    for k, v in seen["before"].items():
        assert v.dtype == seen["after"][k].dtype and torch.equal(v, seen["after"][k]), k
    for k, v in plain_final.items():
        assert torch.equal(seen["final"][k], v), k


def test_sharded_offload_onload_is_bitwise_invisible(ranks):
    for r in ranks:
        _check_offload_cycle(r["offload"], r["plain"]["final"])
        local = {n: off for n, (_, off) in r["shards"].items()}
        assert {n: off for n, (_, off, _) in r["offload"]["host"].items()} == local


def test_sharded_optimizer_state_resumes_per_rank(ranks):
    for r in ranks:
        full, resumed = r["resume"]
        for n, v in full.items():
            assert torch.equal(resumed[n], v), n


# ---- single process ------------------------------------------------------------------------------

def test_world_and_rank_default_without_a_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this process")
    assert (world_size(), rank()) == (1, 0)


def test_per_row_temperatures_equal_each_row_at_its_own_temperature():
    model, (prompts, responses) = _model(), _batch(5)
    temps = [0.7, 1.0, 0.0, 1.3, 0.5]
    engine = TrainingEngine(model, [], PAD)
    with torch.no_grad():
        mixed, mask = engine.response_logprobs(prompts, responses, temps)
        for i, t in enumerate(temps):
            same_batch, _ = engine.response_logprobs(prompts, responses, t)
            torch.testing.assert_close(mixed[i], same_batch[i], atol=0, rtol=0)
            alone, alone_mask = engine.response_logprobs([prompts[i]], [responses[i]], t)
            ref = _reference_logprobs(model, prompts[i], responses[i], t)
            torch.testing.assert_close(alone[0][alone_mask[0]], ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mixed[i][mask[i]], ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="temperatures"):
        engine.response_logprobs(prompts, responses, temps[:2])


def test_step_returns_pre_clip_norm_and_clips():
    model = _model()
    frozen = model.model.layers[0].mlp.up_proj.weight
    frozen.requires_grad_(False)  # its grad stays None
    engine = TrainingEngine(model, [torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)],
                            PAD)
    _reference_nll(model, *_batch()).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    engine.max_grad_norm = norm / 4
    assert engine.step() == pytest.approx(norm, rel=1e-6)
    for n, p in model.named_parameters():
        expected = before[n] - grads[n] * (norm / 4) / (norm + 1e-6) if n in grads else before[n]
        torch.testing.assert_close(p.detach(), expected, atol=1e-7, rtol=1e-6, msg=n)
        assert p.grad is None
    assert engine.step() == 0.0  # no gradients at all: nothing to clip, nothing moves


def test_plain_dummy_backward_leaves_gradients_alone():
    engine = _engine(_model())
    engine.dummy_backward()
    assert all(p.grad is None for p in engine.model.parameters())


def test_plain_offload_onload_is_bitwise_invisible():
    seen = _train(_engine(_model(), "muon"), 3, True)
    _check_offload_cycle(seen, _train(_engine(_model(), "muon"), 3, False)["final"])
    assert all(off == 0 for _, off, _ in seen["host"].values())


def test_offload_misuse_is_an_error():
    engine = _engine(_model())
    with pytest.raises(RuntimeError, match="not offloaded"):
        engine.onload()
    with pytest.raises(RuntimeError, match="only valid while offloaded"):
        engine.host_shards()
    engine.offload()
    with pytest.raises(RuntimeError, match="offloaded"):
        engine.offload()
    with pytest.raises(RuntimeError, match="offloaded"):
        engine.response_logprobs([[2]], [[3]], 1.0)
    with pytest.raises(RuntimeError, match="offloaded"):
        engine.step()
    engine.onload()
    assert not engine.offloaded
    engine.response_logprobs([[2]], [[3]], 1.0)


def test_optimizer_state_round_trip_single_process():
    full, first = _engine(_model(), "muon"), _engine(_model(), "muon")
    _train(full, 2, False)
    _train(first, 1, False)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    resumed = _engine(_model(), "muon")
    resumed.model.load_state_dict(first.model.state_dict())
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    prompts, responses = _batch(8, seed=11)
    lp, _ = resumed.response_logprobs(prompts, responses, 1.0)
    (-lp.sum() / sum(len(r) for r in responses)).backward()
    resumed.step()
    for (n, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


def test_sharded_world_of_one_trains_like_the_plain_model():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this process")
    init_distributed(0, 1, f"tcp://127.0.0.1:{_free_port()}", timeout_s=30)
    try:
        engine = _engine(shard_model(_model()), "muon")
        engine.offload()  # before FSDP's lazy init (the first forward): that must find its storage again
        engine.onload()
        sharded = _train(engine, 2, True)
    finally:
        torch.distributed.destroy_process_group()
    plain = _train(_engine(_model(), "muon"), 2, False)
    for k, v in plain["final"].items():
        torch.testing.assert_close(sharded["final"][k], v, atol=1e-6, rtol=1e-5, msg=k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_uses_pinned_memory_and_one_h2d_pass():
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(_model().cuda(), "muon")
    _train(engine, 1, False)
    before = _snapshot(engine)
    on_device = {t.untyped_storage().data_ptr() for t in
                 [local_tensor(p) for p in engine.model.parameters()]
                 + [v for o in engine.optimizers for st in o.state.values() for v in st.values() if v.is_cuda]}
    allocated = torch.cuda.memory_allocated()
    stats = engine.offload()
    assert torch.cuda.memory_allocated() <= allocated - stats["bytes"]
    assert all(v.is_pinned() and not v.is_cuda for v, _ in engine.host_shards().values())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.onload()
    copies = [e for e in prof.events() if "Memcpy HtoD" in e.name]
    assert len(copies) == len(on_device) and all("Pinned" in e.name for e in copies), [e.name for e in copies]
    after = _snapshot(engine)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
