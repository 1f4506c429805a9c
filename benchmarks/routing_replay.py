"""Routing replay's evidence: how far the trainer's log-probs drift from the rollout's on an MoE, with and without it.

    python -m benchmarks.routing_replay [--json] [--record] [--seed N] [--threads N]

The rollout and the trainer are made to differ as they do on GPUs: the native inference engine serves a bfloat16
replica (recording each token's experts, ``record_routes=True``) while the trainer scores the same tokens in float32
on the same (float32 master) weights. Per MoE family (Qwen3-MoE's softmax router; DeepSeek-V3's grouped sigmoid
router, shared expert and latent attention), on a tiny model of many small experts, reported over the generated
tokens: mean and max |log π_trainer − log π_rollout| when the trainer routes itself (``no_replay``) and when its
forward takes the rollout's recorded experts (``replay``, ``engines.model.native.routing.replaying``); the share of
token-layer pairs whose experts differ between the trainer's own choice and the rollout's (``route_mismatch``); and
the same log-prob difference for the dense model of the same shape (each MoE block replaced by a SwiGLU block as wide
as the experts a token runs: top-k plus the shared ones), the floor that bf16 rounding alone leaves.

One table is printed; ``--json`` adds one JSON record per family (one a line, last); ``--record`` appends them to
``benchmarks/results/routing-replay-cpu-2core.jsonl``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time
from pathlib import Path

import torch

from benchmarks.harness.records import emit
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.native import routing
from engines.model.native.arch import ModelConfig, make_config
from engines.model.native.attention import padded_causal_mask
from engines.model.native.causal_lm import CausalLM, build_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "routing-replay-cpu-2core.jsonl"

#: the family-specific fields of each tiny MoE (shared: ``_SHAPE``); the MoE blocks' own widths come from ``moe``
FAMILIES: dict[str, dict] = {
    "qwen3_moe": dict(head_dim=16, norm_topk_prob=True),
    "deepseek_v3": dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        first_k_dense_replace=1),
}


def family_config(family: str, *, dense: bool = False, experts: int = 32, top_k: int = 4, expert_width: int = 16,
                  layers: int = 4, hidden: int = 64, vocab: int = 256, context: int = 128) -> ModelConfig:
    """The tiny ``family`` model (``dense``: each MoE block a SwiGLU block as wide as a token's active experts)."""
    kw = dict(FAMILIES[family])
    shared = kw.get("n_shared_experts", 0)
    # the dense blocks (DeepSeek's first layer, and all of them in the dense twin) match a token's active width
    width = (top_k + shared) * expert_width
    if family == "qwen3_moe":
        kw.update(num_experts=experts, moe_intermediate_size=expert_width,
                  mlp_only_layers=list(range(layers)) if dense else [])
    else:
        kw.update(n_routed_experts=experts, moe_intermediate_size=expert_width,
                  first_k_dense_replace=layers if dense else kw["first_k_dense_replace"])
    return make_config(family, vocab_size=vocab, hidden_size=hidden, intermediate_size=width,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=context, num_experts_per_tok=top_k, **kw)


def build(cfg: ModelConfig, seed: int, gain: float = 1.0) -> CausalLM:
    """A float32 model whose matrices are N(0, gain²/fan_in): every projection keeps its input's scale, so router
    logits and next-token logits have a spread of about ``gain`` (routes depend on the weights, not on ties)."""
    torch.manual_seed(seed)
    model = build_model(cfg, init=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # linear, embedding, stacked expert [E, out, in] and router matrices
                p.normal_(0.0, gain / math.sqrt(p.shape[-1]))
    return model.eval()


def _rollout(model: CausalLM, prompts: list[list[int]], max_tokens: int, seed: int, record: bool) -> list:
    """Sample every prompt once with a bfloat16 replica of ``model`` in the native engine (the GPU rollout's dtype)."""
    replica = copy.deepcopy(model).to(torch.bfloat16)
    engine = InferenceEngine(replica, eos_id=None, max_seq_len=len(prompts[0]) + max_tokens, kv_cache_bytes=1 << 26,
                             seed=seed, record_routes=record)
    params = [SamplingParams(1.0, max_tokens, ignore_eos=True, seed=seed * 1_000_003 + i) for i in range(len(prompts))]
    return engine.generate(prompts, params)


def _score(model: CausalLM, ids: torch.Tensor, routes: torch.Tensor | None):
    """The float32 trainer's log-probs of every next token [B, T-1] and its forward's route tape (its own routes,
    or under ``routes`` the replayed ones with its own choice beside them)."""
    valid = torch.ones_like(ids, dtype=torch.bool)
    tape = routing.replaying(routes) if routes is not None else routing.recording()
    with torch.no_grad(), tape as t:
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), padded_causal_mask(valid))
    lp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp, t


def _diff(trainer: torch.Tensor, rollout: torch.Tensor) -> dict[str, float]:
    d = (trainer.double() - rollout.double()).abs()
    return {"mean": float(d.mean()), "max": float(d.max())}


def measure(family: str, *, sequences: int = 32, samples: int = 4, prompt_len: int = 16, max_tokens: int = 48,
            seed: int = 0, **shape) -> dict:
    """One family's record: the log-prob differences with and without replay, the route mismatch, the dense floor."""
    start = time.perf_counter()
    cfg = family_config(family, **shape)
    g = torch.Generator().manual_seed(seed)
    # ``samples`` responses per prompt, as a GRPO group: they share the prompt's routes in the engine's prefix cache
    prompts = [p for p in torch.randint(0, cfg.vocab_size, (sequences // samples, prompt_len), generator=g).tolist()
               for _ in range(samples)]
    model = build(cfg, seed)
    done = _rollout(model, prompts, max_tokens, seed, record=True)
    ids = torch.tensor([c.prompt_ids + c.token_ids for c in done])
    theirs = torch.tensor([c.logprobs for c in done])
    gen = slice(prompt_len - 1, None)  # the next-token positions that predict generated tokens
    # the last token was sampled, never read: its route is a stand-in (the previous row), as the trainer pads it
    recorded = torch.stack([torch.as_tensor(c.routed_experts).long() for c in done])  # [B, T-1, layers, k]
    routes = torch.cat((recorded, recorded[:, -1:]), dim=1).flatten(0, 1)
    read = torch.ones(ids.shape, dtype=torch.bool)
    read[:, -1] = False
    read = read.flatten()

    own_lp, own = _score(model, ids, None)
    rep_lp, rep = _score(model, ids, routes)
    mine = routing.stacked(own)[read]
    under_replay = torch.stack([rep.own[i] for i in sorted(rep.own)], dim=1)[read]
    layers = mine.shape[1]
    rec = {
        "family": family, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
        "moe_layers": layers, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
        "expert_width": cfg.moe_intermediate_size, "shared_experts": cfg.n_shared_experts,
        "sequences": len(done), "prompt_tokens": prompt_len, "generated_tokens": int(theirs.numel()),
        "rollout_dtype": "bfloat16", "trainer_dtype": "float32",
        "logprob_diff_no_replay": _diff(own_lp[:, gen], theirs),
        "logprob_diff_replay": _diff(rep_lp[:, gen], theirs),
        # over every token the rollout read (prompt and generated), each MoE layer counted apart
        "route_mismatch": routing.route_mismatch(mine, routes[read]),
        "route_mismatch_by_layer": [routing.route_mismatch(mine[:, i:i + 1], routes[read][:, i:i + 1])
                                    for i in range(layers)],
        # under replay: the trainer's own top-k at the replayed hidden states (what the update's metric reports)
        "route_mismatch_under_replay": routing.route_mismatch(under_replay, routes[read]),
        # the experts the replayed forward ran against the recorded ones: 0 by construction
        "replay_used_mismatch": routing.route_mismatch(routing.stacked(rep)[read], routes[read]),
        "router_entropy": routing.router_health(own, cfg.num_experts)["entropy"],
    }
    dense_cfg = family_config(family, dense=True, **shape)
    dense = build(dense_cfg, seed)
    dense_done = _rollout(dense, prompts, max_tokens, seed, record=False)
    dense_ids = torch.tensor([c.prompt_ids + c.token_ids for c in dense_done])
    dense_lp, _ = _score(dense, dense_ids, None)
    rec["logprob_diff_dense"] = _diff(dense_lp[:, gen], torch.tensor([c.logprobs for c in dense_done]))
    rec["dense_intermediate"] = dense_cfg.intermediate_size
    rec["replay_over_dense_mean"] = rec["logprob_diff_replay"]["mean"] / rec["logprob_diff_dense"]["mean"]
    rec["no_replay_over_dense_mean"] = rec["logprob_diff_no_replay"]["mean"] / rec["logprob_diff_dense"]["mean"]
    rec.update(threads=torch.get_num_threads(), cpus=os.cpu_count(), torch=torch.__version__,
               seconds=round(time.perf_counter() - start, 2))
    return rec


def table(records: list[dict]) -> str:
    """The records as one human-readable table: |Δ log π| per token (mean / max), route mismatch."""
    head = (f"{'family':<12} {'experts':>9} {'no replay mean/max':>20} {'replay mean/max':>20} "
            f"{'dense mean/max':>20} {'replay/dense':>12} {'routes differ':>13} {'under replay':>12}")
    lines = [head, "-" * len(head)]
    for r in records:
        cell = lambda d: f"{d['mean']:.2e}/{d['max']:.2e}"  # noqa: E731
        lines.append(f"{r['family']:<12} {str(r['experts']) + ' top-' + str(r['top_k']):>9} "
                     f"{cell(r['logprob_diff_no_replay']):>20} {cell(r['logprob_diff_replay']):>20} "
                     f"{cell(r['logprob_diff_dense']):>20} {r['replay_over_dense_mean']:>12.2f} "
                     f"{r['route_mismatch']:>13.2%} {r['route_mismatch_under_replay']:>12.2%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Command-line entry point: the table, then with --json one record per family; --record appends them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON record per family after the table")
    ap.add_argument("--record", action="store_true", help=f"append the records to {RESULTS.relative_to(ROOT)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the ops are tiny, and on a shared 2-core machine a second "
                         "OpenMP thread mostly waits at barriers; one run here took 129 s with 2, 7 s with 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    records = [measure(f, seed=args.seed) for f in FAMILIES]
    print("|log π_trainer(fp32) − log π_rollout(bf16)| per generated token; routes differ: token-layer pairs whose "
          "experts differ (trainer's own routing vs the rollout's; under replay: its own choice it did not take)")
    print(table(records))
    emit(records, args.json, RESULTS if args.record else None)
    return records


if __name__ == "__main__":
    main()
