"""Expert-parallel layouts (``trainer.expert_parallel``) in the memory estimate, ``rl memory-plan`` and
``rl plan-update``, checked against parameters counted by name on a tiny native MoE model and on Kimi K2's config."""

import json

import pytest

from engines.model.native.arch import make_config
from engines.model.native.causal_lm import build_model
from rl.cli import main
from rl.config import parse_config
from rl.errors import UserError
from rl.setup import update_cost
from rl.setup.colocation import PRESETS, Colocation, colocation_plan
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


def cfg_of(workers: int, ep: int | None, checkpointing: bool = True, optimizer: str = "adamw"):
    """A run on ``workers`` CPU workers, ``trainer.expert_parallel`` ``ep`` (None: left to its default)."""
    trainer = {"master_dtype": "float32", "param_dtype": "bfloat16", "activation_checkpointing": checkpointing}
    return parse_config({"cluster": {"workers": workers}, "optimizer": {"kind": optimizer},
                         "trainer": trainer | ({} if ep is None else {"expert_parallel": ep}),
                         "algorithm": {"micro_batch_tokens": TOKENS}, "rollout": {"kv_cache_mb": 16}})


def test_a_rank_holds_the_dense_part_over_all_ranks_and_the_experts_over_ep():
    """float32 master weights, AdamW: weights and gradients 4 bytes, optimizer state 8 bytes per parameter; the
    dense part over the 4 ranks, the 16 experts of each MoE layer over ep = 2 (whole: the 2 ranks holding the same
    ones keep copies). Muon takes every stacked expert matrix (one momentum each): only the experts' share moves."""
    count = by_name(tiny())
    dense, experts = count["all"] - count["experts"], count["experts"]
    assert experts == 2 * 3 * 16 * 8 * 32  # two MoE layers of 16 experts of three 8 x 32 matrices
    est = estimate(cfg_of(4, 2), tiny(), 64)
    assert est.trainer_weights == est.trainer_grads == -(-dense * 4 // 4) + experts * 4 // 2
    assert est.optimizer == -(-dense * 8 // 4) + experts * 8 // 2
    flat = estimate(cfg_of(4, 1), tiny(), 64)  # FSDP2 alone: everything over the 4 ranks
    assert flat.trainer_weights == -(-count["all"] * 4 // 4) and flat.optimizer == -(-count["all"] * 8 // 4)
    assert est.params == flat.params == count["all"]
    muon = lambda ep: estimate(cfg_of(4, ep, optimizer="muon"), tiny(), 64).optimizer  # noqa: E731
    assert muon(2) - muon(4) == experts * 4 // 2 - experts * 4 // 4
    assert "trainer weights (shard: experts 1/2, the rest 1/4)" in est.table()
    assert "experts 1/" not in flat.table()


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_working_set_gathers_layers_without_experts_and_adds_the_all_to_alls(checkpointing):
    """FSDP2 gathers two decoder layers in bf16: whole at EP 1, without their routed experts under EP (the largest
    such is the dense first layer). EP adds the dispatch and combine buffers, tokens x top-k rows of the hidden size
    in bf16, and the local experts cast from float32 to bf16 for the backward: one MoE layer's 16 / ep experts when
    layers are recomputed, every MoE layer's otherwise."""
    count = by_name(tiny())
    a2a = 2 * TOKENS * 4 * 32 * 2
    casts = count["layer_experts"] // 2 * 2 * (1 if checkpointing else count["moe_layers"])
    ep, flat = (estimate(cfg_of(4, e, checkpointing), tiny(), 64).activations for e in (2, 1))
    assert ep - flat == 2 * (count["dense_part"] - count["layer"]) * 2 + a2a + casts
    shape = ModelShape.of(tiny())
    # bf16 master weights: the cast is a view, nothing copied
    assert training_working_set(shape, TOKENS, "bfloat16", checkpointing, True, 2, "bfloat16") == \
        training_working_set(shape, TOKENS, "bfloat16", checkpointing, True, 2, "float32") - casts


def test_ep_1_is_fsdp2_alone_as_before():
    """The default and an explicit 1 give the same numbers, every rank holding 1/world of everything."""
    shape = ModelShape.of(tiny())
    for ranks in (1, 4):
        assert trainer_bytes(shape, ranks, "float32", "muon") == trainer_bytes(shape, ranks, "float32", "muon",
                                                                               expert_parallel=1)
        assert training_working_set(shape, TOKENS, "bfloat16", True, ranks > 1) == \
            training_working_set(shape, TOKENS, "bfloat16", True, ranks > 1, 1, "float32")
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


def test_kimi_k2_memory_plan_with_ep_16(capsys):
    """256 GPUs, EP 16, bf16 master weights: a GPU holds 24 of each layer's 384 experts whole (1/16 of 1.01 T
    parameters) and 1/256 of the rest; the trainer no longer gathers 384 experts per layer, but it does not fit."""
    dense, experts = k2_split()
    assert main(["memory-plan", "kimi-k2", "--gpus", "256", "--inference-gpus", "32", "--expert-parallel", "16",
                 "--master-dtype", "bfloat16", "--micro-batch-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "expert parallel 16: each GPU trains 24 of every MoE layer's 384 experts whole" in out
    weights = -(-dense * 2 // 256) + experts * 2 // 16
    rows = {line.rsplit(None, 2)[0].strip(): line.split()[-2] for line in out.splitlines() if "(shard)" in line}
    assert rows["master weights (shard)"] == rows["gradients (shard)"] == f"{weights / GiB:.2f}"
    assert "does NOT fit" in out


def test_kimi_k2_plan_update_with_expert_parallel(capsys):
    """EP 16 on 256 H800: the trainer's shard (bf16 weights, gradients and Muon momentum of 24 experts per layer,
    355 GiB) is refused in one line; EP 128 fits and predicts the same time as EP 1, saying so."""
    dense, experts = k2_split()
    with pytest.raises(SystemExit) as refused:
        update_cost.main(["--expert-parallel", "16"])
    msg = str(refused.value)
    assert msg.startswith("error: Kimi K2 (fp8, TP16, 256 H800, expert parallel 16) does not fit") and "\n" not in msg
    shard = float(msg.split("trainer shard (")[1].split(" GiB")[0])
    assert shard == pytest.approx((experts * 2 * 3 / 16 + dense * 2 * 3 / 256) / GiB, abs=0.2)
    update_cost.main(["--expert-parallel", "128", "--json"])
    ep = json.loads(capsys.readouterr().out)
    update_cost.main(["--json"])
    flat = json.loads(capsys.readouterr().out)
    assert "expert_parallel" not in flat and ep["expert_parallel"]["time_changes"] is False
    assert {k: ep[k] for k in ("total_s", "h2d_s", "deliver_s", "latency_s", "buckets")} == \
        {k: flat[k] for k in ("total_s", "h2d_s", "deliver_s", "latency_s", "buckets")}
    assert ep["expert_parallel"]["trainer_shard_gib"] == pytest.approx((experts * 6 / 128 + dense * 6 / 256) / GiB,
                                                                       abs=0.1)
    update_cost.main(["--expert-parallel", "128"])
    out = capsys.readouterr().out
    assert "expert parallel 128: a GPU holds 3 of every MoE layer's 384 experts whole" in out
    assert "time as at EP 1: each GPU still stages and sends 1/256 of the update" in out
