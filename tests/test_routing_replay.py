"""Routing replay and router health on the native MoE families (engines.model.native.routing): recorded routes
have Sample.routed_experts' layout, replaying them reproduces the forward bit for bit, replaying other routes makes
the experts run be exactly those (checked inside the experts' own forward) while gradients still reach the router,
and the health metrics match numbers computed by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.model.native import routing
from engines.model.native.arch import make_config
from engines.model.native.attention import padded_causal_mask
from engines.model.native.causal_lm import build_model
from engines.model.native.moe import Experts

FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
    # layer 1 dense, layers 0 and 2 MoE: the MoE numbering skips it
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                      norm_topk_prob=False, mlp_only_layers=[1], num_hidden_layers=3),
    "deepseek_v3": dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, num_experts_per_tok=2,
                        routed_scaling_factor=2.5, first_k_dense_replace=1, num_hidden_layers=3),
}
MOE_LAYERS = {"mixtral": 2, "qwen3_moe": 2, "deepseek_v3": 2}


def _model(family: str, seed: int = 0):
    cfg = make_config(family, vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, **FAMILIES[family])
    torch.manual_seed(seed)
    model = build_model(cfg, init=True)
    with torch.no_grad():  # sharper than the init, so that routes depend on the weights
        for p in model.parameters():
            p.mul_(8.0)
    return model.eval(), cfg


def _ids(n: int = 12) -> torch.Tensor:
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(3))


def _forward(model, ids: torch.Tensor) -> torch.Tensor:
    valid = torch.ones_like(ids, dtype=torch.bool)
    return model(ids, torch.arange(ids.shape[1])[None], padded_causal_mask(valid))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_recorded_routes_replayed_give_the_same_forward_bit_for_bit(family):
    model, cfg = _model(family)
    ids = _ids()
    with routing.recording() as tape:
        want = _forward(model, ids)
    routes = routing.stacked(tape)
    assert routes.shape == (ids.numel(), MOE_LAYERS[family], cfg.num_experts_per_tok)
    with routing.replaying(routes) as again:
        got = _forward(model, ids)
    assert torch.equal(got, want)
    assert torch.equal(routing.stacked(again), routes)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replayed_routes_are_the_experts_that_run_and_the_router_still_learns(family, monkeypatch):
    model, _ = _model(family)
    other, _ = _model(family, seed=1)
    ids = _ids()
    with routing.recording() as tape:
        _forward(other, ids)
    routes = routing.stacked(tape)
    with routing.recording() as own:
        _forward(model, ids)
    # another model's routes differ from this one's own choice: the replay is not a no-op
    assert routing.route_mismatch(routing.stacked(own), routes) > 0.3
    used = []
    forward = Experts.forward
    monkeypatch.setattr(Experts, "forward", lambda self, x, w, index: used.append(index) or forward(self, x, w, index))
    model.train()
    with routing.replaying(routes):
        _forward(model, ids).float().logsumexp(-1).sum().backward()
    assert len(used) == MOE_LAYERS[family]
    for layer, index in enumerate(used):
        assert torch.equal(index, routes[:, layer])
    for name, p in model.named_parameters():
        if name.endswith("gate.weight"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_replay_gates_are_the_routers_own_softmax_at_the_replayed_experts():
    """Mixtral renormalises its top-k softmax: under replay each token's weights are its softmax probabilities at
    the replayed experts over their sum, computed here from the router's matrix."""
    model, _ = _model("mixtral")
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    routes = torch.tensor([[0, 3], [1, 2], [3, 1], [2, 0], [0, 1]])
    with routing.replaying(routes[:, None, :]):
        w, index = gate(x)
    probs = torch.softmax(x @ gate.weight.T, dim=-1)
    want = probs.gather(1, routes)
    torch.testing.assert_close(w, want / want.sum(-1, keepdim=True))
    assert torch.equal(index, routes)


def test_router_health_is_the_hand_computed_balance_and_entropy():
    tape = routing.RouteTape()
    # 4 experts, top-1, 4 tokens: loads 3, 1, 0, 0 -> mean 1, std sqrt((4 + 0 + 1 + 1) / 4), max share 3/4 of 4 slots
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 4)
    routing.note(tape, 0, torch.tensor([[0], [0], [0], [1]]), probs)
    h = routing.router_health(tape, 4, reference=torch.tensor([[[0]], [[1]], [[0]], [[1]]]))
    assert h["load_cv"] == pytest.approx((6 / 4) ** 0.5)
    assert h["max_load"] == pytest.approx(3 / 4 * 4)
    assert h["entropy"] == pytest.approx(np.log(2))
    assert h["route_mismatch"] == pytest.approx(1 / 4)


def test_routes_that_do_not_fit_the_model_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"\[tokens, 2 MoE layers, top-2\]"):
        routing.check_routes(np.zeros((5, 3, 2), np.int32), layers=2, top_k=2, num_experts=4)
    with pytest.raises(ValueError, match="outside 0..3"):
        routing.check_routes(np.full((5, 2, 2), 4, np.int32), layers=2, top_k=2, num_experts=4)
    model, _ = _model("mixtral")
    with pytest.raises(ValueError, match="do not fit MoE layer 0 with 12 tokens"), \
            routing.replaying(torch.zeros(7, 2, 2, dtype=torch.long)):
        _forward(model, _ids())


def test_packed_routes_put_each_sequences_routes_at_its_tokens():
    """Sequences recorded alone, packed with first-fit rows: the packed routes replayed reproduce each sequence's
    own forward at its tokens, and a sequence one route short (its last token never fed) is accepted."""
    from engines.training.packing import pack
    from engines.training.routes import pack_routes

    # float64: in float32 the packed rows' other widths sum in other orders, 2.2e-4 apart on these logits of 25 with two
    # threads (3e-5 with one), too near the tolerance; in float64 they are 4e-15 apart and a wrong route moves units
    model = _model("qwen3_moe")[0].double()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 5, 2)]
    responses = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (4, 1, 6)]
    alone, routes = [], []
    for p, r in zip(prompts, responses, strict=True):
        with routing.recording() as tape:
            alone.append(_forward(model, torch.tensor([p + r]))[0])
        routes.append(routing.stacked(tape).numpy())
    routes[2] = routes[2][:-1]
    batch = pack(prompts, responses, pad_id=0, width=9)
    assert batch.ids.shape[0] > 1  # several rows, one with two sequences
    packed = pack_routes(batch, routes, layers=2, top_k=2, num_experts=6)
    assert packed.shape == (batch.ids.numel(), 2, 2)
    with routing.replaying(packed):
        logits = model(batch.ids, batch.positions, batch.mask)
    doc, pos = batch.mask.doc, batch.mask.positions
    for i, want in enumerate(alone):
        got = logits[doc == i][pos[doc == i].argsort()]
        # the last token of sequence 2 took its previous token's route: every other position is the same forward
        keep = slice(None, -1) if i == 2 else slice(None)
        torch.testing.assert_close(got[keep], want[keep], atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="sequence 1 has 2 routes for 6 tokens"):
        pack_routes(batch, [routes[0], routes[1][:2], routes[2]], layers=2, top_k=2, num_experts=6)


def test_the_native_engine_returns_each_fed_tokens_routes_prefix_cache_and_pause_included():
    """An MoE engine recording routes: every completion carries the experts of the prompt and of the generated tokens
    the model read, as a whole-sequence forward of the same tokens chooses them, including the samples whose prompt
    came from the prefix cache (their routes are kept with the cached blocks) and requests paused midway."""
    from engines.inference.native import InferenceEngine
    from engines.inference.sampling import SamplingParams

    model, cfg = _model("qwen3_moe")
    eng = InferenceEngine(model, eos_id=None, max_seq_len=48, kv_cache_bytes=1 << 20, block_size=4,
                          max_num_seqs=8, record_routes=True)
    prompts = [[5, 9, 2, 7, 7, 1, 3], [5, 9, 2, 7, 7, 1, 3], [4, 4, 8], [5, 9, 2, 7, 7, 1, 3, 11, 12]]
    params = [SamplingParams(1.0, 6 + i, ignore_eos=True, seed=i) for i in range(4)]
    done = eng.generate(prompts, params)
    assert eng.stats()["prefix_hit_tokens"] > 0  # some prompts' routes came from cached blocks
    for c in done:
        fed = c.prompt_ids + c.token_ids[:-1]
        with routing.recording() as tape:
            _forward(model, torch.tensor([fed]))
        assert c.routed_experts.shape == (len(fed), 2, cfg.num_experts_per_tok)
        assert routing.route_mismatch(torch.as_tensor(c.routed_experts).long(), routing.stacked(tape)) == 0
    rid = eng.add_request(prompts[2], SamplingParams(1.0, 10, ignore_eos=True, seed=7))
    for _ in range(3):
        eng.step()
    (c,) = eng.pause()
    assert c.request_id == rid and c.finish_reason is None
    assert len(c.routed_experts) == len(c.prompt_ids) + len(c.token_ids) - 1
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        InferenceEngine(build_model(make_config("llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                                                num_attention_heads=4, num_key_value_heads=2), init=True),
                        eos_id=None, max_seq_len=16, kv_cache_bytes=1 << 16, record_routes=True)


def test_a_sample_paused_across_an_update_keeps_each_segments_routes():
    """A turn paused by the budget, the weights changed, the turn resumed: the sample's routes cover every context
    token the model read, those read before the pause as the old weights routed them (the tokens they sampled were
    drawn under those routes), the rest as the new weights route the whole context."""
    from engines.inference.native import InferenceEngine
    from engines.inference.sampling import SamplingParams
    from rl.algo.schedules import Schedule
    from rl.rollout.turns import serve_turns
    from rl.sample import Sample, TaskType

    model, _ = _model("qwen3_moe")
    eng = InferenceEngine(model, eos_id=None, max_seq_len=48, kv_cache_bytes=1 << 20, block_size=4, max_num_seqs=4,
                          record_routes=True)
    kind = TaskType("text", 12, 0.0, Schedule("constant", 1.0, 1.0, 10))
    s = Sample(0, 0, 0, kind, [5, 9, 2, 7, 7, 1], SamplingParams(1.0, 12, ignore_eos=True, seed=3), 0)

    def turn(version, budget):
        (r,), _ = serve_turns(eng, {}, [s.turn_request()], budget, version)
        s.take(r)

    turn(0, 5)
    assert s.status == "paused" and len(s.routed_experts) == len(s.prompt_ids) + len(s.response_ids) - 1
    with routing.recording() as old:
        _forward(model, torch.tensor([list(s.prompt_ids) + list(s.response_ids)]))
    first = s.routed_experts.copy()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)  # other routes everywhere
    eng.weights_loaded()
    turn(1, None)
    assert s.status == "truncated"
    ctx = list(s.prompt_ids) + list(s.response_ids)
    assert s.routed_experts.shape == (len(ctx) - 1, 2, 2)
    assert np.array_equal(s.routed_experts[:len(first)], first)
    assert routing.route_mismatch(torch.as_tensor(first).long(), routing.stacked(old)[:len(first)]) == 0
    with routing.recording() as new:
        _forward(model, torch.tensor([ctx]))
    n = len(first)
    assert routing.route_mismatch(torch.as_tensor(s.routed_experts[n:]).long(), routing.stacked(new)[n:-1]) == 0
    # the new weights route the old tokens otherwise: the kept routes are not the recomputed ones
    assert routing.route_mismatch(torch.as_tensor(first).long(), routing.stacked(new)[:n]) > 0


def test_replay_under_activation_checkpointing_gives_the_same_gradients():
    """The backward's recompute runs outside the replay block: it must replay the same routes, not route anew."""
    other, _ = _model("mixtral", seed=1)
    ids = _ids()
    with routing.recording() as tape:
        _forward(other, ids)
    routes = routing.stacked(tape)
    grads = []
    for checkpointing in (False, True):
        model, _ = _model("mixtral")
        model.train().activation_checkpointing = checkpointing
        with routing.replaying(routes):
            loss = _forward(model, ids).float().logsumexp(-1).sum()
        loss.backward()  # as the trainer does: the forward under the replay, the backward after it
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-5, rtol=1e-5, msg=n)


def test_the_update_trains_on_the_rollouts_routes_and_reports_the_routers_health(monkeypatch):
    """Samples rolled out by another model's routers (their routes recorded by the engine) through ``rl_update``: the
    trainer's forwards run exactly the recorded experts at every real token, and the step's metrics carry the router
    health, its route mismatch being the share of token-layer pairs the trainer's own routers choose otherwise
    (computed here from a forward of each sequence alone)."""
    from engines.inference.native import InferenceEngine
    from engines.inference.sampling import SamplingParams
    from engines.training.engine import TrainingEngine
    from engines.training.packing import pack
    from tests.conftest import make_sample
    from tests.test_algorithm import settings, update

    model, _ = _model("qwen3_moe")
    rollout, _ = _model("qwen3_moe", seed=1)
    eng = InferenceEngine(rollout, eos_id=None, max_seq_len=48, kv_cache_bytes=1 << 20, block_size=4,
                          max_num_seqs=8, record_routes=True)
    prompts = [[5, 9, 2, 7], [5, 9, 2, 7], [4, 4, 8, 1, 3], [4, 4, 8, 1, 3]]
    done = eng.generate(prompts, [SamplingParams(1.0, 5 + i, ignore_eos=True, seed=i) for i in range(4)])
    samples = []
    for i, c in enumerate(done):
        s = make_sample(i // 2, c.prompt_ids, c.token_ids, c.logprobs, reward=float(i % 2))
        s.routed_experts = c.routed_experts
        samples.append(s)
    differ = pairs = 0
    for s in samples:  # the trainer's own choice at each read token (under the replay), against the rollout's
        routes = torch.as_tensor(s.routed_experts).long()
        with routing.replaying(torch.cat((routes, routes[-1:]))) as tape:
            _forward(model, torch.tensor([list(s.prompt_ids) + list(s.response_ids)]))
        mine = torch.stack([tape.own[layer][:-1] for layer in (0, 1)], dim=1)
        differ += routing.route_mismatch(mine, routes) * mine.shape[0] * 2
        pairs += mine.shape[0] * 2
    used = []
    forward = Experts.forward
    monkeypatch.setattr(Experts, "forward", lambda self, x, w, index: used.append(index) or forward(self, x, w, index))
    (metrics,) = update(TrainingEngine(model, [], 0), samples, settings())
    assert metrics["route_mismatch"] == pytest.approx(differ / pairs) and 0 < metrics["route_mismatch"] < 1
    assert metrics["router_load_cv"] >= 0 and metrics["router_max_load"] >= 1 and metrics["router_entropy"] > 0
    # one packed forward: each sequence's read tokens ran the rollout's experts (filler aside)
    assert len(used) == 2
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    batch = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], 0)
    doc, pos = batch.mask.doc.flatten(), batch.mask.positions.flatten()
    for layer, index in enumerate(used):
        for i, s in enumerate(samples):
            at = torch.nonzero(doc == i).squeeze(1)
            got = index[at[pos[at].argsort()]][: lengths[i] - 1]
            assert torch.equal(got, torch.as_tensor(s.routed_experts[:, layer]).long())


def test_routing_replay_is_asked_of_the_native_engine_and_refused_in_one_line_where_it_cannot_run():
    from rl.config import parse_config
    from rl.errors import UserError
    from rl.settings import resolve, routing_replay

    _, moe = _model("qwen3_moe")
    on = {"algorithm": {"routing_replay": "rollout"}}
    assert resolve(parse_config(on), moe, "unused", 64).rollout.engine.record_routes
    assert not resolve(parse_config({}), moe, "unused", 64).rollout.engine.record_routes
    dense = make_config("llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2)
    with pytest.raises(UserError, match="this model has no mixture-of-experts layers; set it off"):
        resolve(parse_config(on), dense, "unused", 64)
    # vLLM's own capture runs in its Model Runner V2, which needs Triton: refused on this CPU build, in one line
    with pytest.raises(UserError, match="Model Runner V2, which needs Triton"):
        resolve(parse_config({**on, "rollout": {"engine": "vllm"}}), moe, "unused", 64)
    with pytest.raises(UserError, match="vLLM returns routes with finished requests only"):
        resolve(parse_config({**on, "rollout": {"engine": "vllm", "partial": {"token_budget": 64}}}), moe, "unused",
                64)
    with pytest.raises(UserError, match="needs the native trainer"):  # transformers' routers are its own
        routing_replay(parse_config(on), True, "transformers", "native")


def test_vllms_routes_keep_the_moe_layers_in_the_native_engines_layout():
    """vLLM returns [tokens, decoder layers, k] with a slot for every layer (dense ones too); the trainer numbers the
    MoE layers only, so the rows keep those, in order."""
    from engines.inference.vllm_routes import moe_routes

    raw = np.arange(5 * 3 * 2).reshape(5, 3, 2)  # 5 tokens, layers 0 and 2 MoE (layer 1 dense), top-2
    got = moe_routes(raw, [0, 2])
    assert got.dtype == np.int32 and got.shape == (5, 2, 2)
    assert np.array_equal(got[:, 0], raw[:, 0]) and np.array_equal(got[:, 1], raw[:, 2])
    with pytest.raises(ValueError, match="returned no routes for a finished request"):
        moe_routes(None, [0, 2])
    with pytest.raises(ValueError, match=r"not \[tokens, decoder layers, top_k\]"):
        moe_routes(raw[:, :2], [0, 2])


@pytest.mark.skipif(not __import__("importlib").util.find_spec("vllm"), reason="vLLM is not installed")
def test_a_vllm_replica_asked_for_routes_it_cannot_give_is_refused_in_one_line(tmp_path):
    """This CPU build of vLLM has the capture option but runs it only in Model Runner V2 (Triton): the engine says
    so before vLLM starts, rather than serving completions without routes."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs
    from vllm.triton_utils import HAS_TRITON

    from engines.inference.vllm_engine import VllmEngine
    from engines.inference.vllm_routes import OPTION, routes_unsupported

    assert OPTION in {f.name for f in dataclasses.fields(EngineArgs)}  # the option this code sets exists
    if HAS_TRITON:
        pytest.skip("vLLM finds Triton here: its Model Runner V2 may capture routes")
    assert "Model Runner V2" in routes_unsupported("cpu")
    with pytest.raises(ValueError, match="record_routes: vLLM returns MoE routes only from its Model Runner V2"):
        VllmEngine(tmp_path, [0], record_routes=True)


def test_rl_trains_progress_line_shows_the_routers_health(tmp_path):
    """An MoE iteration's line carries the busiest expert's load, the load's spread and the route mismatch; a dense
    model's carries none of it."""
    import io

    from rich.console import Console

    from rl.loop.metrics import MetricsLog

    out = io.StringIO()
    log = MetricsLog(tmp_path, Console(file=out, width=400))
    base = {"iteration": 0, "reward_mean": 0.5, "response_len": 9.0, "truncation_rate": 0.0, "temperature": 1.0}
    log.record(dict(base))
    log.record({**base, "iteration": 1, "router_max_load": 1.8, "router_load_cv": 0.42, "route_mismatch": 0.031})
    dense, moe = out.getvalue().splitlines()[-2:]
    assert "experts" not in dense
    assert "experts max-load 1.80x cv 0.42 mismatch 3.1%" in moe
