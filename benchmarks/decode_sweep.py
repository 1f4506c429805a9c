"""Decode-step sweep: the seconds of one decode step of the native engine's model runner, by batch, model and
attention backend, against the step's read roofline. No prompts and no scheduler: synthetic block tables over a
pool of random keys and values, random weights.

    python -m benchmarks.decode_sweep --device cuda --dtype bfloat16 --json    # 0.6 B and 8 B, torch and triton
    python -m benchmarks.decode_sweep --device cuda --dtype bfloat16 --compile qwen3-0.6b --json  # then compiled
    python -m benchmarks.decode_sweep --models demo --batches 1 2 4 --context 32 --json   # the same on a CPU

Every row of a batch decodes the token at position ``context - 1``: it writes that token's key and value and
attends to all ``context`` tokens of its sequence, whose blocks are scattered over the pool (a random permutation,
seeded, as blocks lie after a rollout's churn), so no row reads another's keys. A step is the model's forward from
the rows' last tokens to their logits (``ModelRunner.decode_logits``, what a graph of the engine replays), sampling
not included. On a GPU the step is captured as a CUDA graph and replayed, as the engine runs it (``step_s``), and
also timed eagerly (``eager_step_s``: launch-bound at small batches); on a CPU it runs eagerly.

The read roofline of a step (``benchmarks.roofline``): every weight once (of an untied input embedding the looked-up
rows) plus ``batch × context`` tokens' keys and values, over the read bandwidth measured at the start of the run
and over the device's nominal one; ``roofline_fraction`` is the roofline's seconds over the step's. A batch whose
pool and temporaries would not fit the free memory is recorded as skipped, as is a backend this device lacks. Each
point is printed as a JSON line as soon as it is measured, so a sweep cut at its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from benchmarks.rollout import ROLLOUT_MODELS
from benchmarks.roofline import device_name, read_bandwidth, roofline_fields, step_read_bytes, weight_read_bytes
from benchmarks.timing import best_seconds, say
from engines.inference.kv_cache import BLOCK_SIZE, bytes_per_token, decode_attention, gather_bytes
from engines.inference.native import InferenceEngine
from engines.model.native.causal_lm import build_model

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: the share of the free device memory the pool and a step's temporaries may take
MEMORY_SHARE = 0.85


def fitting_rows(cfg, dtype: torch.dtype, context: int, batches: list[int], device: torch.device) -> int:
    """The largest of ``batches`` whose pool (``context`` tokens a row) and step temporaries (the torch path's
    gathered keys and values, the logits) fit ``MEMORY_SHARE`` of the free memory; every batch on a CPU."""
    if device.type != "cuda":
        return max(batches)
    free = torch.cuda.mem_get_info(device)[0] * MEMORY_SHARE
    blocks = -(-context // BLOCK_SIZE)
    ok = [b for b in batches if (b * blocks + 1) * BLOCK_SIZE * bytes_per_token(cfg, dtype)
          + 2 * gather_bytes(cfg, b, context, dtype) + 2 * b * cfg.vocab_size * 4 <= free]
    return max(ok, default=0)


def step_seconds(engine: InferenceEngine, rows: int, context: int, tries: int) -> tuple[float, float | None]:
    """(seconds of one decode step of ``rows`` rows: a CUDA graph's replay on a GPU, else eager; eager seconds on a
    GPU, else None)."""
    runner, dev = engine.runner, engine.device

    def step() -> torch.Tensor:
        return runner.decode_logits(rows, context)

    step()  # first-call work (a kernel's compile, the allocator's first blocks) out of the timing
    eager = best_seconds(step, dev, tries)
    if dev.type != "cuda":
        return eager, None
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):  # capture's warm-up runs on the capture stream
        step()
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    reps = 10  # replays per timing: one replay of a small step is shorter than the timer's resolution warrants
    replayed = best_seconds(lambda: [graph.replay() for _ in range(reps)], dev, tries) / reps
    graph.reset()  # its private pool goes back with it
    torch.cuda.empty_cache()
    return replayed, eager


def synthetic_rows(engine: InferenceEngine, context: int, seed: int = 0) -> None:
    """Give every row of ``engine`` a sequence of ``context`` tokens in blocks scattered over the pool (a seeded
    permutation: no two rows share a block), a random last token, and random keys and values in the pool (the
    attention's arithmetic is the same as on real ones)."""
    runner = engine.runner
    rows, blocks = runner.block_table.shape
    g = torch.Generator().manual_seed(seed)
    runner.block_table.copy_(torch.randperm(rows * blocks, generator=g).view(rows, blocks))
    runner.pos.fill_(context - 1)
    runner.last.copy_(torch.randint(2, engine.model.config.vocab_size, runner.last.shape, generator=g))
    cache = runner.cache()
    cache.k.normal_()
    if cache.v is not None:
        cache.v.normal_()


def sweep_model(name: str, device: torch.device, dtype: torch.dtype, backends: list[str], batches: list[int],
                context: int, read_bps: float, tries: int = 3, compiled: bool = False):
    """The sweep's records for one model: one per (backend, batch), yielded as each is measured; ``compiled``: the
    model's decoder layers compiled around the attention (``rollout.compile``), each batch's first step compiling
    what it needs outside the timing."""
    cfg = ROLLOUT_MODELS[name]
    if context > cfg.max_position_embeddings:
        raise SystemExit(f"--context {context} exceeds the {name} model's context of {cfg.max_position_embeddings}")
    torch.manual_seed(0)
    model = build_model(cfg, device, dtype, init=True)
    rows_max = fitting_rows(cfg, dtype, context, batches, device)
    base = {"benchmark": "decode_sweep", "model": name, "params": sum(p.numel() for p in model.parameters()),
            "context": context, "dtype": str(dtype).removeprefix("torch."), "device": device_name(device),
            "compiled": compiled}
    blocks = -(-context // BLOCK_SIZE)
    per_block = BLOCK_SIZE * bytes_per_token(cfg, dtype)
    # one engine for every backend: torch, triton and paged read the same 16-token blocks, so they share one copy
    # of the weights and one pool (an 8 B model's pool takes most of a GPU); flex's 128-token blocks are not swept
    engine = InferenceEngine(model, eos_id=None, max_seq_len=context, max_num_seqs=max(rows_max, 1),
                             kv_cache_bytes=per_block * (max(rows_max, 1) * blocks + 1), block_size=BLOCK_SIZE,
                             cuda_graphs=False, attention="torch", compiled=compiled)
    say("decode_sweep", f"{name} up on {device}: {rows_max} rows of {context} tokens at most")
    synthetic_rows(engine, context)
    weights, per_token = weight_read_bytes(model), bytes_per_token(cfg, dtype)
    for backend in backends:
        try:
            # the backend that runs (paged falls back to torch where the CPU kernel does not build)
            ran = engine.runner.attention = engine.attention = decode_attention(backend, device)
        except ValueError as e:
            yield {**base, "backend": backend, "skipped": str(e)}
            continue
        for b in batches:
            if b > rows_max:
                yield {**base, "backend": backend, "batch": b, "skipped": "does not fit the free memory"}
                continue
            step_s, eager_s = step_seconds(engine, b, context, tries)
            read = step_read_bytes(weights, b, b * context, per_token)
            yield {**base, "backend": ran, "batch": b, "mode": "graph" if eager_s else "eager",
                   "step_s": round(step_s, 6), "eager_step_s": None if eager_s is None else round(eager_s, 6),
                   "tok_s": round(b / step_s, 1),
                   **roofline_fields(b, step_s, read, read_bps, base["device"])}
    del engine, model  # the weights' and the pool's arenas go with their last views, before the next model's
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, printing one JSON line per point (and a table on stderr unless ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=sorted(ROLLOUT_MODELS), default=["qwen3-0.6b", "qwen3-8b"])
    ap.add_argument("--backends", nargs="+", choices=["torch", "triton", "paged"], default=["torch", "triton"])
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--context", type=int, default=1024, help="tokens each row attends to (default 1024)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tries", type=int, default=3, help="timings per point, the best kept")
    ap.add_argument("--compile", nargs="*", default=[], choices=sorted(ROLLOUT_MODELS), metavar="MODEL",
                    help="after the sweep, these models again with compiled decoder layers (rollout.compile), on the "
                         "last backend")
    ap.add_argument("--json", action="store_true", help="only the JSON lines")
    a = ap.parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    read_bps = read_bandwidth(device)
    say("decode_sweep", f"read bandwidth {read_bps / 1e9:.1f} GB/s")
    runs = [(name, a.backends, False) for name in a.models] + [(name, a.backends[-1:], True) for name in a.compile]
    with torch.no_grad():
        for name, backends, compiled in runs:
            for rec in sweep_model(name, device, dtype, backends, a.batches, a.context, read_bps, a.tries, compiled):
                print(json.dumps(rec), flush=True)
                if not a.json and "skipped" not in rec:
                    print(f"{name:11s} {rec['backend'] + '+c' * compiled:9s} batch {rec['batch']:4d}: "
                          f"{rec['step_s'] * 1e3:9.3f} ms, "
                          f"{rec['tok_s']:10.1f} tok/s, "
                          f"{rec['roofline_fraction']:.1%} of the read roofline", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
