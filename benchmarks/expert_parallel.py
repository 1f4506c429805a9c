"""Expert-parallel training of a Kimi K2-shaped miniature on CPU ranks: the planner's traffic beside the measured.

    python -m benchmarks.expert_parallel [--ranks 4] [--eps 1,2,4] [--steps 3] [--json] [--record]

The miniature has K2's shape (DeepSeek-V3 layout: latent attention, a dense first layer, many small routed experts
in groups with a grouped sigmoid router, one shared expert). ``--ranks`` gloo ranks train it with Muon, each on its
own tokens, once per expert-parallel size (1: FSDP2 alone). Per size, on rank 0: the step's median seconds, the loss
against EP = 1's (the same numbers up to float32 sums), the bytes of experts the rank holds, and per collective the
bytes the rank sent in one step, measured (the all-to-alls count their rows; FSDP2's and the experts' all-gathers
and reduce-scatters are counted at the call, as ring collectives send) beside ``rl.setup.traffic``'s prediction. On
2 CPU cores the step times say little about a GPU cluster; the traffic and memory do.

One table is printed; ``--json`` adds one JSON record per size (one a line, last); ``--record`` appends them to
``benchmarks/results/expert-parallel-cpu-2core.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness.records import emit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "expert-parallel-cpu-2core.jsonl"
K2_MINI = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=4, max_position_embeddings=256, q_lora_rank=32, kv_lora_rank=16,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=32, n_shared_experts=1,
               n_group=4, topk_group=2, num_experts_per_tok=4, moe_intermediate_size=32, routed_scaling_factor=2.5,
               first_k_dense_replace=1)
SEQS, PROMPT, RESPONSE = 8, 16, 48  # per rank and step


def k2_mini():
    from engines.model.native.arch import make_config

    return make_config("deepseek_v3", **K2_MINI)


class Wire:
    """Bytes this rank sends per collective kind, counted at the call (ring algorithms' share of the data): FSDP2's
    gathers and reduce-scatters over all the ranks, and the experts' over the ranks storing the same ones."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.sent = dict.fromkeys(("fsdp_all_gather", "fsdp_reduce_scatter", "expert_all_gather",
                                   "expert_reduce_scatter"), 0)
        # FSDP2's own entry points (torch.distributed.fsdp's DefaultAllGather / DefaultReduceScatter), which the
        # experts' gathers use too
        self._orig = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single")}

        def kind(group) -> str:
            return "fsdp" if dist.get_world_size(group) == dist.get_world_size() else "expert"

        def gather(output_tensor, input_tensor, group=None, async_op=False):
            n = dist.get_world_size(group)
            self.sent[kind(group) + "_all_gather"] += input_tensor.numel() * input_tensor.element_size() * (n - 1)
            return self._orig["all_gather_single"](output_tensor, input_tensor, group=group, async_op=async_op)

        def scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            n = dist.get_world_size(group)
            self.sent[kind(group) + "_reduce_scatter"] += input.numel() * input.element_size() * (n - 1) // n
            return self._orig["reduce_scatter_single"](output=output, input=input, op=op, group=group,
                                                       async_op=async_op)

        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter

    def take(self) -> dict[str, int]:
        out, self.sent = self.sent, dict.fromkeys(self.sent, 0)
        return out


def _batch(step: int, rank: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(2, vocab, (SEQS, PROMPT + RESPONSE), generator=g).tolist()
    return [r[:PROMPT] for r in ids], [r[PROMPT:] for r in ids]


def _train(ep: int, world: int, rank: int, steps: int, wire: Wire) -> dict:
    from engines.model.native.causal_lm import build_model
    from engines.model.sharded import local_tensor
    from engines.training import expert_parallel
    from engines.training.distributed import shard_model
    from engines.training.engine import TrainingEngine
    from engines.training.optim import build_optimizers
    from engines.training.parallel_dims import ParallelDims

    cfg = k2_mini()
    torch.manual_seed(0)
    dims = ParallelDims(workers=world, ep=ep)
    model = shard_model(build_model(cfg, init=True), expert_mesh=dims.build_expert_mesh("cpu"))
    engine = TrainingEngine(model, build_optimizers(model, "muon", lr=2e-2, weight_decay=0.0), 0, max_grad_norm=1.0)
    shards = expert_parallel.expert_shards(model)
    losses, seconds, traffic = [], [], {}
    for step in range(steps):
        prompts, responses = _batch(step, rank, cfg.vocab_size)
        wire.take()
        [s.take_sent() for s in shards]
        start = time.perf_counter()
        lp, _ = engine.response_logprobs(prompts, responses, 1.0)
        loss = -lp.sum() / (SEQS * RESPONSE * world)
        loss.backward()
        engine.step()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step == steps - 1:
            traffic = {**wire.take(), "all_to_all": sum(s.take_sent() for s in shards)}
    experts = [p for b in expert_parallel.expert_blocks(model) for p in b.parameters(recurse=False)]
    return {"losses": losses, "seconds": seconds, "traffic": traffic,
            "expert_bytes": sum(local_tensor(p).numel() * p.element_size() for p in experts),
            "expert_bytes_total": sum(p.numel() * p.element_size() for p in experts),
            "tokens": SEQS * (PROMPT + RESPONSE)}


def _rank(rank: int, world: int, port: int, out: str, eps: list[int], steps: int, threads: int) -> None:
    import torch.distributed as dist

    from engines.training.distributed import init_distributed

    torch.set_num_threads(threads)
    init_distributed(rank, world, f"tcp://127.0.0.1:{port}")
    wire = Wire()
    try:
        res = {ep: _train(ep, world, rank, steps, wire) for ep in eps}
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run(world: int, eps: list[int], steps: int, threads: int = 1) -> list[dict]:
    """One record per expert-parallel size, as rank 0 saw it (see the module)."""
    import tempfile

    from benchmarks.harness.ranks import rank_context, rank_process
    from rl.setup.traffic import step_traffic

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        ctx = rank_context()
        procs = [rank_process(ctx, _rank, (r, world, port, out, eps, steps, threads)) for r in range(world)]
        [p.start() for p in procs]
        [p.join() for p in procs]
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    records = []
    for ep in eps:
        got, ref = ranks[0][ep], ranks[0][eps[0]]
        predicted = step_traffic(k2_mini(), got["tokens"], world, ep)
        measured = {**got["traffic"], "total": sum(got["traffic"].values())}
        records.append({"benchmark": "expert_parallel", "model": "k2-mini", "ranks": world, "ep": ep,
                        "threads_per_rank": threads, "step_s": statistics.median(got["seconds"][1:] or got["seconds"]),
                        "loss_max_abs_diff_vs_ep1": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"],
                                                                                     strict=True)),
                        "expert_bytes_per_rank": got["expert_bytes"], "expert_bytes": got["expert_bytes_total"],
                        "measured_bytes": measured, "predicted_bytes": predicted,
                        "cpu": os.cpu_count(), "torch": torch.__version__, "when": time.strftime("%Y-%m-%d")})
    return records


def table(records: list[dict]) -> str:
    kinds = ["all_to_all", "fsdp_all_gather", "fsdp_reduce_scatter", "expert_all_gather", "expert_reduce_scatter",
             "total"]
    lines = [f"K2-mini on {records[0]['ranks']} gloo ranks (rank 0): bytes sent per step, measured / predicted",
             f"{'ep':>3} {'step s':>7} {'|Δloss|':>8} {'experts/rank':>13} " +
             " ".join(f"{k:>25}" for k in kinds)]
    for r in records:
        cells = [f"{r['measured_bytes'][k] / 2**20:9.2f}/{r['predicted_bytes'][k] / 2**20:8.2f} MiB" for k in kinds]
        lines.append(f"{r['ep']:>3} {r['step_s']:7.3f} {r['loss_max_abs_diff_vs_ep1']:8.1e} "
                     f"{r['expert_bytes_per_rank'] / r['expert_bytes']:12.3f}x " + " ".join(f"{c:>25}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Command-line entry point: the table, then with --json one record per size; --record appends them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--eps", default="1,2,4", help="expert-parallel sizes, comma-separated (1 first: the reference)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--record", action="store_true", help=f"append the records to {RESULTS.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    eps = [int(e) for e in args.eps.split(",")]
    records = run(args.ranks, eps, args.steps, args.threads)
    print(table(records))
    emit(records, args.json, RESULTS if args.record else None)
    return records


if __name__ == "__main__":
    main()
