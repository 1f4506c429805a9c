"""Optimizer benchmark: one MuonClip step (Muon + AdamW for the rest, then QK-Clip) against one AdamW step.

    python -m benchmarks.optimizer --json                 # the demo model
    python -m benchmarks.optimizer --model 100m --json    # the ~88M-parameter model of benchmarks.rollout

One model with a fixed random gradient on every parameter. ``muon_step_s`` is the median wall time of
``build_optimizers(model, "muon", ...)`` stepping every optimizer and then ``qk_clip`` with tracked
maxima set so that a quarter of the heads clip; ``qk_clip_s`` is the QK-Clip part alone. ``adamw_step_s``
is ``build_optimizers(model, "adamw", ...)`` stepping the same parameters (``--torch-muon`` adds the Muon
set-up with ``torch.optim.Muon`` as a peer). The two are timed in
alternation after warm-up steps, so that load from other processes hits both alike. ``ratio`` is
muon / adamw. ``ns_floor_s`` is the Newton–Schulz matmul FLOPs divided by the GEMM throughput of the path
the project's Muon takes here (``ns_matmul``: bfloat16 kernels, or float32 where bfloat16 is emulated because
the device has no bfloat16 GEMM), measured in the same run on the largest matrix shape: roughly the least
time a Muon step can take. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.rollout import MODELS
from benchmarks.timing import best_seconds
from engines.device import synchronize
from engines.model.native.attention import Attention
from engines.model.native.causal_lm import CausalLM
from engines.training.muon import emulate_bf16_matmul
from engines.training.optim import build_optimizers
from engines.training.qk_clip import qk_clip

TAU = 100.0
DEFAULT_REPEATS = {"demo": 20, "100m": 5}


def set_max_logits(model: torch.nn.Module, tau: float = TAU) -> int:
    """Give every attention layer tracked maxima with every fourth head over ``tau``; returns their count."""
    over = 0
    for m in model.modules():
        if isinstance(m, Attention):
            h = m.num_heads
            s = torch.full((h,), tau / 2, device=next(m.parameters()).device)
            s[::4] = tau * 1.5
            m.max_logits = s
            over += len(range(0, h, 4))
    return over


def newton_schulz_flops(shapes: list[tuple[int, int]], ns_steps: int = 5) -> float:
    """Matmul FLOPs of Muon's Newton–Schulz for matrices of these shapes (X Xᵀ, G G, (·) X per step)."""
    total = 0.0
    for r, c in shapes:
        n, m = min(r, c), max(r, c)
        total += ns_steps * (4 * n * n * m + 2 * n ** 3)
    return total



def gemm_flops_per_s(shape: tuple[int, int], batch: int = 4, tries: int = 3, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.bfloat16) -> float:
    """This machine's X·Xᵀ throughput in ``dtype`` on matrices of ``shape`` (best of ``tries``)."""
    device = torch.device(device)
    n, m = min(shape), max(shape)
    x = torch.randn(batch, n, m, device=device).to(dtype)
    out = torch.empty(batch, n, n, dtype=dtype, device=device)
    torch.bmm(x, x.mT, out=out)
    return 2 * batch * n * n * m / best_seconds(lambda: torch.bmm(x, x.mT, out=out), device, tries)


def _step(opts: list[torch.optim.Optimizer], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    for o in opts:
        o.step()
    synchronize(device)
    return time.perf_counter() - t0


def measure(model_name: str, repeats: int = 5, warmup: int = 2, lr: float = 1e-3, seed: int = 0,
            torch_muon: bool = False, device: str = "cpu") -> dict:
    """Build the model, time the set-ups in alternation; returns the JSON record.

    ``torch_muon`` also times the same set-up with ``torch.optim.Muon`` in place of the project's Muon.
    """
    cfg = MODELS[model_name]
    torch.manual_seed(seed)
    dev = torch.device(device)
    model = CausalLM(cfg).to(dev)
    g = torch.Generator().manual_seed(seed + 1)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dev)
    muon = build_optimizers(model, "muon", lr, 0.1)
    adamw = build_optimizers(model, "adamw", lr, 0.1)
    peer = [torch.optim.Muon(muon[0].param_groups[0]["params"], lr=lr, weight_decay=0.1,
                             adjust_lr_fn="match_rms_adamw"), *muon[1:]] if torch_muon else []
    muon_s, clip_s, adamw_s, peer_s = [], [], [], []
    clipped = 0
    for i in range(warmup + repeats):
        set_max_logits(model)
        t_opt = _step(muon, dev)
        t0 = time.perf_counter()
        metrics = qk_clip(model, TAU)
        synchronize(dev)
        t_clip = time.perf_counter() - t0
        t_adamw = _step(adamw, dev)
        t_peer = _step(peer, dev)
        if i >= warmup:
            muon_s.append(t_opt + t_clip)
            clip_s.append(t_clip)
            adamw_s.append(t_adamw)
            peer_s.append(t_peer + t_clip)
            clipped = int(metrics["qk_clipped_heads"])
    muon_step, adamw_step = statistics.median(muon_s), statistics.median(adamw_s)
    shapes = [tuple(p.shape) for grp in muon[0].param_groups for p in grp["params"]]
    hidden = sum(r * c for r, c in shapes)
    flops = newton_schulz_flops(shapes)
    emulated = emulate_bf16_matmul(dev.type)
    rate = gemm_flops_per_s(max(shapes, key=lambda s: s[0] * s[1]), device=dev,
                            dtype=torch.float32 if emulated else torch.bfloat16)
    return {"muon_step_s": round(muon_step, 5), "adamw_step_s": round(adamw_step, 5),
            "ratio": round(muon_step / adamw_step, 3), "qk_clip_s": round(statistics.median(clip_s), 6),
            "params": sum(p.numel() for p in model.parameters()), "muon_params": hidden,
            "qk_clipped_heads": clipped, "ns_gflop": round(flops / 1e9, 2),
            "ns_matmul": "float32 (bfloat16 emulated)" if emulated else "bfloat16",
            "gemm_gflops": round(rate / 1e9, 1), "ns_floor_s": round(flops / rate, 5),
            "model": model_name, "threads": torch.get_num_threads(), "device": device,
            "repeats": repeats, "muon_all_s": [round(t, 5) for t in muon_s],
            "adamw_all_s": [round(t, 5) for t in adamw_s],
            **({"torch_muon_step_s": round(statistics.median(peer_s), 5)} if torch_muon else {})}


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point; prints a summary and, with --json, the record as the last line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"timed steps of each set-up, median reported (default {DEFAULT_REPEATS})")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (optimizer state allocation)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--torch-muon", action="store_true",
                    help="also time the set-up with torch.optim.Muon (+ QK-Clip) as a peer")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", action="store_true", help="print the JSON record as the last line")
    args = ap.parse_args(argv)
    args.repeats = DEFAULT_REPEATS[args.model] if args.repeats is None else args.repeats
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    rec = measure(args.model, args.repeats, args.warmup, torch_muon=args.torch_muon, device=args.device)
    print(f"model {rec['model']}: {rec['params'] / 1e6:.1f}M params ({rec['muon_params'] / 1e6:.1f}M under Muon), "
          f"{rec['threads']} threads")
    print(f"  Muon set-up + QK-Clip: {rec['muon_step_s'] * 1e3:9.2f} ms/step  "
          f"(QK-Clip {rec['qk_clip_s'] * 1e3:.3f} ms, {rec['qk_clipped_heads']} heads clipped)")
    if "torch_muon_step_s" in rec:
        print(f"  same, torch.optim.Muon:{rec['torch_muon_step_s'] * 1e3:9.2f} ms/step")
    print(f"  AdamW:                 {rec['adamw_step_s'] * 1e3:9.2f} ms/step")
    print(f"  ratio muon/adamw:      {rec['ratio']:9.2f}")
    print(f"  Newton–Schulz alone: {rec['ns_gflop']:.1f} GFLOP, {rec['ns_floor_s'] * 1e3:.2f} ms at this machine's "
          f"{rec['gemm_gflops']:.0f} GFLOP/s {rec['ns_matmul']} GEMM")
    if args.json:
        print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    main()
