"""Expert-parallel training equals the FSDP2-only trainer: the same losses, gradients, grad norm and weights after two
Muon steps (≤ 1e-6; bit for bit on 2 ranks in float32, in float64 on 4 ranks, see ``DTYPE``), for the native MoE
families (Mixtral, Qwen3-MoE, DeepSeek-V3 / a K2-shaped miniature with MLA and a shared expert) and a
transformers-backend one (Qwen2-MoE), at EP = 2 on 2 ranks and EP = 4 and 2 on 4 ranks (where two groups compute the
same experts and store them sharded between them); each rank stores 1/world of the experts' bytes (whole experts)
and computes 1/EP of them; the weight-update plan sends each expert from the one rank that stores it; the planner's
traffic matches the wire's; bad sizes are refused in one line.

Both trainers run in the same rank processes (one spawn per world size), on the same per-rank batches, so the only
difference is where the experts live and how tokens reach them.
"""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.expert_parallel import Wire
from checkpoint_engine.model_sender import local_parts, plan_model_update
from engines.model.native import routing
from engines.model.native.arch import make_config
from engines.model.native.causal_lm import build_model
from engines.model.sharded import chunk_rows, full_state_dict, local_shards, local_tensor
from engines.training import expert_parallel
from engines.training.distributed import PARAM_DTYPES, init_distributed, shard_model
from engines.training.engine import TrainingEngine
from engines.training.muon import ShardedMuon
from engines.training.optim import build_optimizers
from engines.training.parallel_dims import ParallelDims
from rl.setup.traffic import step_traffic
from tests.ranks import rank_body, run_ranks

VOCAB = 64
FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                      norm_topk_prob=False, mlp_only_layers=[1], num_hidden_layers=3),
    # K2's shape in miniature: MLA, many small experts in groups, one shared expert, a dense first layer
    "deepseek_v3": dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        n_routed_experts=16, n_shared_experts=1, n_group=4, topk_group=2, num_experts_per_tok=4,
                        moe_intermediate_size=8, routed_scaling_factor=2.5, first_k_dense_replace=1,
                        num_hidden_layers=3),
}
#: a transformers-backend family (no native code): transformers' own experts and router, split the same way
HF_FAMILIES = ("qwen2_moe",)
STEPS = 2
WIRE = None  # the rank's collective byte counter (benchmarks.expert_parallel.Wire)
SHARP = 2.0  # weights scaled up from the init, so that routes and losses depend on them
#: On 2 ranks EP sums its parts as FSDP2's reduce-scatter does, so float32 runs are equal bit for bit. On 4 ranks the
#: two levels of reduction sum in other orders: float32's last-bit differences, which AdamW's division by √v magnifies
#: (an embedding row moved 1.08e-6 apart after two steps on an AVX-512 machine, 4e-7 on AVX2), would measure rounding,
#: not EP. Those runs are in float64, where summation order shows at 1e-16, so any EP error stands out at 1e-6.
DTYPE = {2: "float32", 4: "float64"}


def _model(family: str):
    if family in HF_FAMILIES:
        from engines.model.hf.backend import build_hf_model
        from tests.hf_families import hf_config, sharpen

        torch.manual_seed(0)
        cfg = hf_config(family, num_hidden_layers=2)
        # transformers' eager expert loop, whose matmuls the split experts run; its default on CPU, grouped_mm, sums
        # in another order (its gradients differ from these by ~5e-8, which AdamW magnifies on near-zero biases)
        cfg._experts_implementation = "eager"
        return sharpen(build_hf_model(cfg), std=0.1)
    cfg = make_config(family, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, **FAMILIES[family])
    torch.manual_seed(0)
    model = build_model(cfg, init=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(SHARP)
    return model


def _batch(step: int, n: int = 8):
    rng = random.Random(100 + step)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 7))] for _ in range(n)]
    responses = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 7))] for _ in range(n)]
    return prompts, responses


def _train(family: str, dims: ParallelDims, me: int) -> dict:
    """Two Muon steps of the global token-mean NLL, this rank's rows me::world; what a user would compare."""
    engine = _engine(family, dims)
    model = engine.model
    for opt in engine.optimizers:
        if isinstance(opt, ShardedMuon):  # the run's dtype throughout: bf16 Newton–Schulz would turn last-bit
            opt.ns_dtype = PARAM_DTYPES[DTYPE[dims.world]]  # differences into bf16 steps (see the benchmark)
    grads: dict = {}

    def keep_grads(opt, *_):
        if not grads:
            grads.update({n: local_tensor(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None})
    for opt in engine.optimizers:
        opt.register_step_pre_hook(keep_grads)
    out = {"loss": [], "norm": []}
    shards = expert_parallel.expert_shards(model)
    for step in range(STEPS):
        prompts, responses = _batch(step)
        n = sum(len(r) for r in responses)
        WIRE.take()
        with routing.recording() as tape:
            lp, _ = engine.response_logprobs(prompts[me::dims.world], responses[me::dims.world], 1.0)
        loss = -lp.sum() / n
        loss.backward()
        out["loss"].append(loss.item())
        out["norm"].append(engine.step())
        if step == 0:
            out["grads"] = _full(model, grads)
            tokens = sum(len(p) + len(r) for p, r in zip(prompts[me::dims.world], responses[me::dims.world],
                                                          strict=True))
            out["traffic"] = {**WIRE.take(), "all_to_all": sum(s.take_sent() for s in shards)}
            if family in HF_FAMILIES:
                continue
            size = PARAM_DTYPES[DTYPE[dims.world]].itemsize
            out["predicted"] = step_traffic(model.config, tokens, dims.world, dims.ep, compute_bytes=size,
                                            master_bytes=size)
            # rows this rank's routes sent away; each row crosses the wire 4 times (dispatch, combine and their
            # backwards), twice from each end, so over all ranks the all-to-alls carry 4x these
            per, mine = model.config.num_experts // dims.ep, me % dims.ep
            routes = routing.stacked(tape)
            away = int((routes // per != mine).sum()) if dims.ep > 1 else 0
            out["routed_away_bytes"] = 4 * away * model.config.hidden_size * size
    out["weights"] = full_state_dict(model)
    experts = [p for b in expert_parallel.expert_blocks(model) for p in b.parameters(recurse=False)]
    out["expert_bytes"] = (sum(local_tensor(p).numel() * p.element_size() for p in experts),
                           sum(p.numel() * p.element_size() for p in experts))
    shards = expert_parallel.expert_shards(model)
    out["num_experts"] = expert_parallel.expert_blocks(model)[0].num_experts
    out["computed_experts"] = shards[0].per_rank if shards else out["num_experts"]
    if family in HF_FAMILIES:
        return out
    # who sends what in a weight update to a replica of the unsharded model (hub names: one tensor per expert)
    plan = plan_model_update(model, local_parts(local_shards(model)), 1 << 14, build_model(model.config, device="meta"))
    senders: dict[str, set[int]] = {}
    for k, bucket in enumerate(plan.buckets):
        for piece in bucket:
            senders.setdefault(piece.name, set()).add(plan.owners[k])
    out["senders"] = senders
    return out


def _full(model, grads: dict) -> dict:
    """Each gradient whole (gathered from its shards: FSDP2's over all ranks, the experts' over their EP group)."""
    params = dict(model.named_parameters())
    out = {}
    for n, g in grads.items():
        p = params[n]
        if isinstance(p, torch.distributed.tensor.DTensor):
            d = torch.distributed.tensor.DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape,
                                                            stride=p.stride())
            out[n] = d.full_tensor()
        else:
            out[n] = g
    return out


def _rank(me: int, world: int, port: int, out_dir: str, eps: list[int]) -> None:
    with rank_body(me, out_dir):
        init_distributed(me, world, f"tcp://127.0.0.1:{port}")
        global WIRE
        WIRE = Wire()
        torch.manual_seed(0)
        res = {}
        for family in [*FAMILIES, *HF_FAMILIES]:
            res[family] = {ep: _train(family, ParallelDims(workers=world, ep=ep), me) for ep in [1, *eps]}
        res["resume"] = _resume_across_layouts("deepseek_v3", world, eps[-1], me, out_dir)
        res["skewed"] = {family: {ep: _skewed(family, ParallelDims(workers=world, ep=ep), me) for ep in [1, *eps]}
                         for family in ("mixtral", "deepseek_v3")}
        torch.save(res, f"{out_dir}/rank{me}.pt")


def _engine(family: str, dims: ParallelDims) -> TrainingEngine:
    dtype = DTYPE[dims.world]
    model = shard_model(_model(family).to(PARAM_DTYPES[dtype]), dtype, expert_mesh=dims.build_expert_mesh("cpu"))
    return TrainingEngine(model, build_optimizers(model, "muon", lr=2e-2, weight_decay=0.1), 0, max_grad_norm=1e9)


def _full_state(engine: TrainingEngine) -> dict:
    """Weights and optimizer state, gathered whole, by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    weights, optim = get_state_dict(engine.model, engine.optimizers, options=StateDictOptions(full_state_dict=True))
    return {"weights": weights, "optim": {f"{k}/{n}": v for k, st in optim["state"].items() for n, v in st.items()
                                          if isinstance(v, torch.Tensor)}}


def _skewed(family: str, dims: ParallelDims, me: int) -> dict:
    """One backward where rank 0 sends every token to experts 0..k-1 (replayed routes: the other places get no row)
    while the other ranks run the engine's dummy passes (two filler tokens): the gradients, gathered whole."""
    engine = _engine(family, dims)
    prompts, responses = _batch(0)
    if me == 0:
        with torch.no_grad(), routing.recording() as tape:
            engine.response_logprobs(prompts, responses, 1.0)
        k = engine.model.config.num_experts_per_tok
        routes = torch.arange(k).expand(routing.stacked(tape).shape).contiguous()
        with routing.replaying(routes):
            lp, _ = engine.response_logprobs(prompts, responses, 1.0)
        (-lp.sum() / sum(len(r) for r in responses)).backward()
    else:
        engine.dummy_forward()
        engine.dummy_backward()
    return _full(engine.model, {n: local_tensor(p.grad) for n, p in engine.model.named_parameters()
                                if p.grad is not None})


def _resume_across_layouts(family: str, world: int, ep: int, me: int, out_dir: str) -> dict:
    """A step at EP ``ep``, its trainer state saved; then loaded by a fresh EP trainer and by an FSDP2-only one:
    what each holds (the checkpoint resumes on either layout)."""
    from engines.training.trainer_state import load_trainer_state, save_trainer_state

    dims = ParallelDims(workers=world, ep=ep)
    engine = _engine(family, dims)
    prompts, responses = _batch(0)
    lp, _ = engine.response_logprobs(prompts[me::world], responses[me::world], 1.0)
    (-lp.sum() / sum(len(r) for r in responses)).backward()
    engine.step()
    path = f"{out_dir}/state-{family}"
    save_trainer_state(engine.model, engine.optimizers, path)
    out = {"saved": _full_state(engine)}
    for name, layout in (("ep", dims), ("fsdp", ParallelDims(workers=world))):
        again = _engine(family, layout)
        load_trainer_state(again.model, again.optimizers, path)
        out[name] = _full_state(again)
    return out


@pytest.fixture(scope="module", params=[(2, [2]), (4, [4, 2])], ids=["2ranks", "4ranks"])
def runs(request, tmp_path_factory):
    world, eps = request.param
    return world, eps, run_ranks(_rank, tmp_path_factory.mktemp(f"ep{world}"), eps, world=world)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """|a − b| ≤ 1e-6 elementwise, relative to |b| where that exceeds 1 (float32 resolves 36.78 to 4e-6)."""
    assert a.shape == b.shape, what
    err = ((a - b).abs() / b.abs().clamp(min=1.0)).max().item() if a.numel() else 0.0
    assert err <= 1e-6, f"{what}: max |Δ| {err:.2e}"


def _equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.equal(a, b), f"{what}: max |Δ| {(a - b).abs().max().item():.2e}"


@pytest.mark.parametrize("family", [*FAMILIES, *HF_FAMILIES])
def test_expert_parallel_equals_the_fsdp_trainer(runs, family):
    """≤ 1e-6 everywhere; on two ranks, where the expert-parallel forward runs FSDP2's own matmuls and sums two
    parts as its reduce-scatter does, losses, gradients and weights are equal bit for bit."""
    world, eps, ranks = runs
    for me, res in enumerate(ranks):
        ref = res[family][1]
        for ep in eps:
            got = res[family][ep]
            same = _close if world > 2 else _equal
            for s in range(STEPS):
                same(torch.tensor(got["loss"][s]), torch.tensor(ref["loss"][s]), f"ep={ep} rank {me} loss {s}")
                _close(torch.tensor(got["norm"][s]), torch.tensor(ref["norm"][s]), f"ep={ep} rank {me} norm {s}")
            assert set(got["grads"]) == set(ref["grads"])
            for n in ref["grads"]:
                same(got["grads"][n], ref["grads"][n], f"ep={ep} rank {me} grad {n}")
            assert set(got["weights"]) == set(ref["weights"])
            for n in ref["weights"]:
                same(got["weights"][n], ref["weights"][n], f"ep={ep} rank {me} weight {n} after {STEPS} steps")
    # the steps moved the weights: the comparison is not of two untouched models
    start = _model(family).to(PARAM_DTYPES[DTYPE[world]]).state_dict()
    moved = [n for n in start if n in ranks[0][family][1]["weights"]
             and not torch.equal(start[n], ranks[0][family][1]["weights"][n])]
    assert any(".experts." in n for n in moved) and any("q_proj" in n or "q_a_proj" in n for n in moved)


@pytest.mark.parametrize("family", [*FAMILIES, *HF_FAMILIES])
def test_each_rank_stores_whole_experts_a_world_th_of_them_and_computes_an_ep_th(runs, family):
    """Measured on the ranks: the experts' bytes each stores are 1/world of all (whole experts, 1/ep of them shared
    with the other groups' same place), and a forward computes 1/ep of them (the ones its all-to-all feeds)."""
    world, eps, ranks = runs
    for res in ranks:
        for ep in [1, *eps]:
            local, total = res[family][ep]["expert_bytes"]
            assert local * world == total, (ep, local, total)
        for ep in eps:
            assert res[family][ep]["computed_experts"] * ep == res[family][ep]["num_experts"]


def test_each_expert_reaches_a_replica_whole_from_a_rank_that_holds_it(runs):
    world, eps, ranks = runs
    for family in FAMILIES:
        for ep in eps:
            senders = ranks[0][family][ep]["senders"]
            assert all(s == ranks[1][family][ep]["senders"][n] for n, s in senders.items())  # one plan on all ranks
            experts = {n: s for n, s in senders.items() if ".experts." in n and ".shared_experts." not in n}
            assert experts
            per = _model(family).config.num_experts // ep
            counts = chunk_rows(per, world // ep)
            for n, s in experts.items():
                e = int(n.split(".experts.")[1].split(".")[0])
                # the one rank storing it: its group place e // per, the replica j whose chunk holds it
                j = next(j for j in range(len(counts)) if e % per < sum(counts[:j + 1]))
                assert s == {j * ep + e // per}, (ep, n, s)
            assert set().union(*experts.values()) == set(range(world)), ep  # every rank sends its own
            # the rest is FSDP2's: row shards of every rank
            assert set().union(*(s for n, s in senders.items() if n not in experts)) == set(range(world))


def test_the_planner_predicts_each_ranks_step_traffic(runs):
    """FSDP2's and the experts' gathers and reduce-scatters to the byte; the all-to-alls to the byte of the
    routes the tokens took, and within 35 % of the planner's even spread (these few tokens route unevenly), over all
    ranks (a rank sends back what others sent it, which its own tokens do not decide)."""
    _, eps, ranks = runs
    for family in FAMILIES:
        for ep in eps:
            measured = sum(r[family][ep]["traffic"]["all_to_all"] for r in ranks)
            assert measured == sum(r[family][ep]["routed_away_bytes"] for r in ranks), (family, ep)
            predicted = sum(r[family][ep]["predicted"]["all_to_all"] for r in ranks)
            assert abs(measured - predicted) <= 0.35 * predicted, (family, ep, measured, predicted)
    for res in ranks:
        for family in FAMILIES:
            for ep in [1, *eps]:
                got, want = res[family][ep]["traffic"], res[family][ep]["predicted"]
                for kind in ("fsdp_all_gather", "fsdp_reduce_scatter", "expert_all_gather", "expert_reduce_scatter"):
                    assert got[kind] == want[kind], (family, ep, kind, got, want)
                assert (got["all_to_all"] == 0) == (ep == 1)


def test_a_checkpoint_resumes_on_either_layout(runs):
    """Trainer state saved at EP (on 4 ranks: experts sharded over the two groups' replicas) loads into a fresh EP
    trainer and into an FSDP2-only one with every weight and optimizer state equal."""
    _, _, ranks = runs
    for res in ranks:
        saved = res["resume"]["saved"]
        assert any(".experts." in n for n in saved["weights"]) and saved["optim"]
        for layout in ("ep", "fsdp"):
            got = res["resume"][layout]
            assert set(got["weights"]) == set(saved["weights"]) and set(got["optim"]) == set(saved["optim"])
            for kind in ("weights", "optim"):
                for n, v in saved[kind].items():
                    assert torch.equal(got[kind][n], v), (layout, kind, n)


def test_ranks_whose_experts_get_no_tokens_still_meet_their_peers(runs):
    """All of rank 0's tokens go to experts 0..k-1 and the other ranks pass two filler tokens: most experts get no row
    anywhere, yet every rank runs every collective (no hang) and the gradients equal FSDP2's."""
    world, eps, ranks = runs
    for res in ranks:
        for family, by_ep in res["skewed"].items():
            ref = by_ep[1]
            assert any(".experts." in n and g.abs().sum() > 0 for n, g in ref.items())
            for ep in eps:
                assert set(by_ep[ep]) == set(ref), (family, ep)
                for n, g in ref.items():
                    (_close if world > 2 else _equal)(by_ep[ep][n], g, f"{family} ep={ep} grad {n}")


def test_bad_expert_parallel_sizes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="ep=3 does not divide the 4 trainer ranks"):
        ParallelDims(workers=4, ep=3)
    with pytest.raises(ValueError, match="ep=4 does not divide the model's 6 experts"):
        expert_parallel.check_experts(build_model(make_config(
            "qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
            num_hidden_layers=1), device="meta"), 4)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        expert_parallel.check_experts(build_model(make_config(
            "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=1), device="meta"), 2)


def test_a_run_asks_for_expert_parallel_in_its_config_and_bad_ones_are_refused_in_one_line():
    from rl.config import parse_config
    from rl.errors import UserError
    from rl.settings import resolve

    moe = _model("qwen3_moe").config  # 8 experts
    dense = make_config("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2)

    def run(ep: int, workers: int = 4, **extra) -> dict:
        return {"cluster": {"workers": workers}, "trainer": {"expert_parallel": ep}, **extra}
    settings = resolve(parse_config(run(4)), moe, "unused", 64)
    assert settings.trainer.parallel == ParallelDims(workers=4, ep=4)
    with pytest.raises(UserError, match="ep=4 does not divide the 2 trainer ranks"):
        resolve(parse_config(run(4, workers=2)), moe, "unused", 64)
    with pytest.raises(UserError, match="3 does not divide the model's 8 experts"):
        resolve(parse_config(run(3, workers=3)), moe, "unused", 64)
    with pytest.raises(UserError, match="this model has no mixture-of-experts layers; set it to 1"):
        resolve(parse_config(run(2)), dense, "unused", 64)


def test_the_transformers_backend_splits_its_standard_experts_and_refuses_others_in_one_line():
    from engines.model.hf.spec import describe
    from rl.config import parse_config
    from rl.errors import UserError
    from rl.settings import resolve
    from tests.hf_families import hf_config

    run = {"cluster": {"workers": 2}, "trainer": {"expert_parallel": 2}, "model": {"backend": "transformers"}}
    settings = resolve(parse_config(run), describe(hf_config("qwen2_moe")), "unused", 64)
    assert settings.trainer.parallel.ep == 2 and settings.trainer.backend == "transformers"
    with pytest.raises(UserError, match="GptOssExperts .* is not supported; set it to 1"):
        resolve(parse_config(run), describe(hf_config("gpt_oss")), "unused", 64)
