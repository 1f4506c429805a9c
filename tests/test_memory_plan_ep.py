"""Expert-parallel layouts (``trainer.expert_parallel``) in the memory estimate, ``rl memory-plan`` and
``rl plan-update``, checked against parameters counted by name on a tiny native MoE model and on Kimi K2's config."""

import functools
import json

import pytest
import torch

from engines.model.native.arch import make_config
from engines.model.native.causal_lm import build_model
from rl.cli import main
from rl.config import parse_config
from rl.errors import UserError
from rl.setup import update_cost
from rl.setup.colocation import PRESETS, Colocation, colocation_plan, preset
from rl.setup.memory import ModelShape, estimate, trainer_bytes, training_working_set
from tests.test_memory import _k2_params_by_hand

GiB = 2**30
# K2's shape in miniature: MLA, 16 experts of which 4 per token, one shared expert, a dense first layer
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, n_routed_experts=16, n_shared_experts=1, n_group=4, topk_group=2, num_experts_per_tok=4,
            moe_intermediate_size=8, routed_scaling_factor=2.5, first_k_dense_replace=1, num_hidden_layers=3,
            bos_token_id=None, eos_token_id=None, pad_token_id=0)
TOKENS = 256


def tiny():
    return make_config("deepseek_v3", **TINY)


def by_name(arch) -> dict[str, int]:
    """Parameters counted by name: all, the routed experts (``.experts.``, not ``.shared_experts.``), the largest
    decoder layer whole and without its experts, and the experts of one MoE layer."""
    named = {n: p.numel() for n, p in build_model(arch, device="meta").named_parameters()}
    routed = lambda n: ".experts." in n and ".shared_experts." not in n  # noqa: E731
    layers: dict[str, list[int]] = {}
    for n, k in named.items():
        if n.startswith("model.layers."):
            layer = layers.setdefault(n.split(".")[2], [0, 0])
            layer[0] += k
            layer[1] += k if routed(n) else 0
    return {"all": sum(named.values()), "experts": sum(k for n, k in named.items() if routed(n)),
            "layer": max(a for a, _ in layers.values()), "dense_part": max(a - e for a, e in layers.values()),
            "layer_experts": max(e for _, e in layers.values()), "moe_layers": sum(1 for _, e in layers.values() if e)}


def cfg_of(workers: int, ep: int | None, checkpointing: bool = True, optimizer: str = "adamw",
           master: str = "float32"):
    """A run on ``workers`` CPU workers, ``trainer.expert_parallel`` ``ep`` (None: left to its default)."""
    trainer = {"master_dtype": master, "param_dtype": "bfloat16", "activation_checkpointing": checkpointing}
    return parse_config({"cluster": {"workers": workers}, "optimizer": {"kind": optimizer},
                         "trainer": trainer | ({} if ep is None else {"expert_parallel": ep}),
                         "algorithm": {"micro_batch_tokens": TOKENS}, "rollout": {"kv_cache_mb": 16}})


def busiest(computed: int, replicas: int) -> int:
    """The most experts one of ``replicas`` ranks stores of the ``computed`` they share, as ``torch.chunk`` splits."""
    return max(len(c) for c in torch.arange(computed).chunk(replicas))


def test_a_rank_stores_whole_experts_about_one_in_ranks_and_the_dense_part_over_all():
    """float32 master weights, AdamW: weights and gradients 4 bytes, optimizer state 8 bytes per parameter; the
    dense part over all the ranks. Each group of ep ranks computes 16 / ep of each MoE layer's 16 experts, and the
    ranks / ep ranks computing the same ones store them whole, torch.chunk style: on 4 ranks at ep 2 the 8 over 2,
    4 each (what FSDP2 alone holds, 1/4); on 6 ranks the 8 over 3 as 3, 3, 2, so the busiest rank holds 3 / 16 of
    the experts, more than 1/6. The share depends on the ranks, not on ep (ep 4 on 4 ranks: 4 each, as at ep 2)."""
    count = by_name(tiny())
    dense, experts = count["all"] - count["experts"], count["experts"]
    assert experts == 2 * 3 * 16 * 8 * 32  # two MoE layers of 16 experts of three 8 x 32 matrices
    assert (busiest(8, 2), busiest(8, 3), busiest(4, 1)) == (4, 3, 4)
    for workers, ep, stored in ((4, 2, 4), (6, 2, 3), (4, 4, 4)):
        est = estimate(cfg_of(workers, ep), tiny(), 64)
        assert est.trainer_weights == est.trainer_grads == -(-dense * 4 // workers) + experts * 4 * stored // 16
        assert est.optimizer == -(-dense * 8 // workers) + experts * 8 * stored // 16
        assert est.params == count["all"]
        assert f"trainer weights (shard: experts {stored} of 16 per layer, the rest 1/{workers})" in est.table()
    for optimizer in ("adamw", "muon"):  # 16 experts over 4 ranks evenly: FSDP2's bytes, Muon's momentum too
        ep, flat = (estimate(cfg_of(4, e, optimizer=optimizer), tiny(), 64) for e in (2, 1))
        assert (ep.trainer_weights, ep.trainer_grads, ep.optimizer) == \
            (flat.trainer_weights, flat.trainer_grads, flat.optimizer)
        assert flat.trainer_weights == -(-count["all"] * 4 // 4) and "per layer, the rest" not in flat.table()
        ep, flat = (estimate(cfg_of(6, e, optimizer=optimizer), tiny(), 64) for e in (2, 1))
        states = 1 if optimizer == "muon" else 2  # Muon takes every stacked expert matrix: one momentum each
        assert ep.optimizer - flat.optimizer == pytest.approx(experts * 4 * states * (3 / 16 - 1 / 6), abs=1)
        assert ep.trainer_weights - flat.trainer_weights == pytest.approx(experts * 4 * (3 / 16 - 1 / 6), abs=1)


@pytest.mark.parametrize("master", ["float32", "bfloat16"])
@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_working_set_gathers_each_layers_experts_over_their_replicas(checkpointing, master):
    """FSDP2 gathers two decoder layers in bf16: whole at EP 1, without their routed experts under EP (the largest
    such is the dense first layer). EP adds the dispatch and combine buffers (tokens x top-k rows of the hidden size
    in bf16, each way), what the backward keeps of the 16 / ep experts each MoE layer computes (one layer's when
    layers are recomputed, both MoE layers' otherwise): from float32 master weights their bf16 casts; from bf16 the
    experts gathered over the r = ranks / ep replicas, nothing when r = 1 (the stored parameters themselves); and with
    r > 1 one layer's gather in flight in the master dtype: the 16 / ep experts and the all-gather's r padded shares."""
    count = by_name(tiny())
    one = count["layer_experts"] // 16  # one expert of one MoE layer
    layers = 1 if checkpointing else count["moe_layers"]
    mb = 4 if master == "float32" else 2
    a2a = 2 * TOKENS * 4 * 32 * 2
    shape = ModelShape.of(tiny())
    for workers, ep in ((2, 2), (4, 2), (6, 2), (4, 4)):
        computed, r = 16 // ep, workers // ep
        kept = computed * one * layers * (2 if master == "float32" else 2 if r > 1 else 0)
        flight = (computed + r * busiest(computed, r)) * one * mb if r > 1 else 0
        ep_ws, flat = (estimate(cfg_of(workers, e, checkpointing, master=master), tiny(), 64).activations
                       for e in (ep, 1))
        assert ep_ws - flat == 2 * (count["dense_part"] - count["layer"]) * 2 + a2a + kept + flight, (workers, ep)
        assert ep_ws == training_working_set(shape, TOKENS, "bfloat16", checkpointing, True, ep, master, workers)
    with pytest.raises(ValueError, match="does not divide"):
        training_working_set(shape, TOKENS, "bfloat16", checkpointing, True, 2, master)  # one rank, ep 2


def test_ep_1_is_fsdp2_alone_as_before():
    """The default and an explicit 1 give the same numbers, every rank holding 1/world of everything."""
    shape = ModelShape.of(tiny())
    for ranks in (1, 4):
        assert trainer_bytes(shape, ranks, "float32", "muon") == trainer_bytes(shape, ranks, "float32", "muon",
                                                                               expert_parallel=1)
        assert training_working_set(shape, TOKENS, "bfloat16", True, ranks > 1) == \
            training_working_set(shape, TOKENS, "bfloat16", True, ranks > 1, 1, "float32", ranks)
    assert trainer_bytes(shape, 4, "float32", "adamw")[0] == -(-by_name(tiny())["all"] * 4 // 4)
    assert estimate(cfg_of(4, None), tiny(), 64) == estimate(cfg_of(4, 1), tiny(), 64)
    setup = Colocation(gpus=4, gpu_bytes=GiB)
    assert colocation_plan(tiny(), setup).parts == colocation_plan(tiny(), Colocation(gpus=4, gpu_bytes=GiB,
                                                                                      expert_parallel=1)).parts


def test_bad_expert_parallel_sizes_are_refused_in_one_line(capsys):
    cases = [(["memory-plan", "kimi-k2", "--gpus", "256", "--expert-parallel", "5"], "does not divide the model's 384"),
             (["memory-plan", "kimi-k2", "--gpus", "200", "--expert-parallel", "64"], "not divide the 200 trainer"),
             (["memory-plan", "llama-7b", "--expert-parallel", "2"], "no mixture-of-experts layers"),
             (["memory-plan", "kimi-k2", "--gpus", "256", "--expert-parallel", "16", "--lora", "8"], "LoRA"),
             (["plan-update", "--expert-parallel", "5"], "does not divide the model's 384 experts"),
             (["plan-update", "--nodes", "3", "--expert-parallel", "16"], "does not divide the 24 trainer ranks"),
             (["plan-update", "--expert-parallel", "0"], "must be at least 1")]
    for argv, why in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and why in err and err.count("\n") == 1, err
    for workers, ep, why in ((4, 3, "does not divide the 4 trainer ranks"), (6, 3, "does not divide the model's 16")):
        with pytest.raises(UserError, match=why) as e:
            estimate(cfg_of(workers, ep), tiny(), 64)
        assert "\n" not in str(e.value)
    dense = make_config("llama", **{k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                          "num_attention_heads", "num_key_value_heads")},
                        num_hidden_layers=2, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with pytest.raises(UserError, match="no mixture-of-experts layers"):
        estimate(cfg_of(4, 2), dense, 64)


def k2_split() -> tuple[int, int]:
    """Kimi K2's (dense, routed experts) parameters from its config: 60 MoE layers of 384 experts of three
    7168 x 2048 matrices."""
    c = PRESETS["kimi-k2"][1]
    experts = (c["num_hidden_layers"] - c["first_k_dense_replace"]) * c["n_routed_experts"] * 3 * \
        c["hidden_size"] * c["moe_intermediate_size"]
    return _k2_params_by_hand(c) - experts, experts


def test_the_memory_plan_says_what_each_gpu_computes_and_stores():
    """``rl memory-plan``'s line: with replicas the stored share and the gather; with none (ep = GPUs) it is whole."""
    line = lambda gpus: colocation_plan(tiny(), Colocation(gpus=gpus, gpu_bytes=GiB, expert_parallel=2)) \
        .table().splitlines()[1]  # noqa: E731
    assert line(6) == ("expert parallel 2: each GPU computes 8 of every MoE layer's 16 experts and stores at most 3 "
                       "of them, whole (the 3 GPUs computing the same 8 split them, gathered a layer at a time); the "
                       "rest sharded over 6; tokens travel to their experts (all-to-all)")
    assert line(2).startswith("expert parallel 2: each GPU computes 8 of every MoE layer's 16 experts and stores them "
                              "whole; the rest sharded over 2;")


@functools.cache
def k2_shape() -> ModelShape:
    return ModelShape.of(preset("kimi-k2"))


def k2_expert() -> tuple[int, int, int]:
    """Kimi K2's one routed expert of one layer (three 7168 x 2048 matrices), MoE layers, and the largest decoder
    layer without its routed experts less the largest whole (the dense first layer's MLP less a MoE layer's router
    and 385 experts: attention and norms are alike)."""
    c = PRESETS["kimi-k2"][1]
    d, one = c["hidden_size"], 3 * c["hidden_size"] * c["moe_intermediate_size"]
    moe = c["n_routed_experts"] * d + (c["n_routed_experts"] + c["n_shared_experts"]) * one
    return one, c["num_hidden_layers"] - c["first_k_dense_replace"], 3 * d * c["intermediate_size"] - moe


@pytest.mark.parametrize("master", ["float32", "bfloat16"])
def test_kimi_k2_memory_plan_with_ep_16(capsys, master):
    """256 GPUs, EP 16: each GPU computes 24 of each layer's 384 experts and stores 2 of them (the 24 over the 16
    GPUs computing them: ⌈24/16⌉ = 2, 1/192 of 1.01 T parameters) and 1/256 of the rest. Its working set gathers
    the dense first layer at most, and adds the all-to-alls (4096 tokens x 8 x 7168 in bf16, each way), one
    layer's 24 experts kept in bf16 (cast from float32, or as gathered) and one gather in flight (24 + 16 x 2
    experts in the master dtype). With bf16 master weights it fits; with float32 the training phase does not."""
    dense, experts = k2_split()
    one, _, dense_less_layer = k2_expert()
    mb = 4 if master == "float32" else 2
    assert main(["memory-plan", "kimi-k2", "--gpus", "256", "--inference-gpus", "32", "--expert-parallel", "16",
                 "--master-dtype", master, "--micro-batch-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "expert parallel 16: each GPU computes 24 of every MoE layer's 384 experts and stores at most 2 of them, " \
           "whole (the 16 GPUs computing the same 24 split them, gathered a layer at a time)" in out
    weights = -(-dense * mb // 256) + experts * mb * 2 // 384
    rows = {line.rsplit(None, 2)[0].strip(): line.split()[-2] for line in out.splitlines() if "(shard)" in line}
    assert rows["master weights (shard)"] == rows["gradients (shard)"] == f"{weights / GiB:.2f}"
    setup = dict(gpus=256, gpu_bytes=80 * GiB, inference_gpus=32, master_dtype=master, micro_batch_tokens=4096)
    ep, flat = (colocation_plan(preset("kimi-k2"), Colocation(**setup, expert_parallel=e), shape=k2_shape())
                for e in (16, 1))
    work = "training working set (4096 tokens)"
    assert ep.parts[work] - flat.parts[work] == \
        2 * dense_less_layer * 2 + 2 * 4096 * 8 * 7168 * 2 + 24 * one * 2 + (24 + 16 * 2) * one * mb
    # the replica asleep (sleep level 2); Muon's one momentum per expert element, AdamW's two on the embeddings
    assert ep.phases["training"] == 2 * weights + ep.parts["optimizer state (shard)"] + ep.parts[work]
    assert ("fits" if master == "bfloat16" else "does NOT fit") in out.splitlines()[-2]
    assert ep.fits == (master == "bfloat16")


def test_kimi_k2_plan_update_with_expert_parallel(capsys):
    """256 H800: a GPU stores 2 of each layer's 384 experts whatever ep is (bf16 weights, gradients and Muon
    momentum: 29.8 GiB), so EP 16 and EP 128 both fit and predict EP 1's time, saying so; on 32 GPUs (12 per
    layer, as FSDP2 alone) the shard is refused in one line."""
    dense, experts = k2_split()
    # bf16 weights, gradients, Muon's momentum (AdamW's two moments of the embeddings add about 4.4 GiB / gpus)
    shard = lambda gpus, stored: (dense * 6 / gpus + experts * 6 * stored / 384) / GiB  # noqa: E731
    update_cost.main(["--json"])
    flat = json.loads(capsys.readouterr().out)
    assert "expert_parallel" not in flat
    for e in (16, 128):
        update_cost.main(["--expert-parallel", str(e), "--json"])
        ep = json.loads(capsys.readouterr().out)
        note = ep["expert_parallel"]
        assert note["time_changes"] is False and (note["experts_computed"], note["experts_stored"]) == (384 // e, 2)
        assert {k: ep[k] for k in ("total_s", "h2d_s", "deliver_s", "latency_s", "buckets")} == \
            {k: flat[k] for k in ("total_s", "h2d_s", "deliver_s", "latency_s", "buckets")}
        assert note["trainer_shard_gib"] == pytest.approx(shard(256, 2), abs=0.05)
    update_cost.main(["--expert-parallel", "16"])
    out = capsys.readouterr().out
    assert "expert parallel 16: a GPU computes 24 of every MoE layer's 384 experts and stores at most 2 of them " \
           "whole, and 1/256 of the rest: trainer shard 29.8 GiB per GPU" in out
    assert "time as at EP 1: each GPU still stages and sends about 1/256 of the update" in out
    with pytest.raises(SystemExit) as refused:
        update_cost.main(["--nodes", "4", "--expert-parallel", "16"])
    msg = str(refused.value)
    assert msg.startswith("error: Kimi K2 (fp8, TP16, 32 H800, expert parallel 16) does not fit") and "\n" not in msg
    assert "a GPU stores 12 of every MoE layer's 384 experts whole" in msg
    assert float(msg.split("trainer shard (")[1].split(" GiB")[0]) == pytest.approx(shard(32, 12), abs=0.3)
