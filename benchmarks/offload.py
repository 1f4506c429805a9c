"""Offload benchmark: the training engine's offload/onload against a plain copy of the same bytes.

    python -m benchmarks.offload --json                 # the demo model
    python -m benchmarks.offload --model 100m --json    # the ~88M-parameter model of benchmarks.rollout

The engine holds the model and its optimizer state (Muon on the layers' matrices, AdamW on the
rest) after one real step. ``offload_s`` / ``onload_s`` are medians over ``--repeats`` cycles after
a warm-up cycle. ``copy_s`` is the floor: one contiguous ``torch.empty(n, dtype=uint8)`` allocated
and filled by ``copy_`` from a buffer of the same n bytes, on the onload's device pair (host to host
on CPU, pinned host to device on CUDA; ``copy_d2h_s`` is the offload's pair). On CPU the memory goes
back to the OS between copies, as the engine's does, so both pay for fresh pages. ``rss_freed_mib``
is the process RSS drop over an offload: on CPU the bytes only move into the host buffer, so it
shows what else was freed (gradients, allocator slack). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks.rollout import MODELS
from engines.device import malloc_trim, synchronize
from engines.model.native.causal_lm import CausalLM
from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc/self/statm; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0



def copy_seconds(nbytes: int, src_device: torch.device, dst_device: torch.device, repeats: int) -> float:
    """Median time to allocate ``nbytes`` on ``dst_device`` and copy them there from ``src_device``."""
    pin = torch.cuda.is_available() and "cuda" in (src_device.type, dst_device.type)
    src = torch.ones(nbytes, dtype=torch.uint8, device=src_device, pin_memory=pin and src_device.type == "cpu")
    times = []
    for _ in range(repeats + 1):  # the first one warms allocators up
        synchronize(src_device)
        t0 = time.perf_counter()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device, pin_memory=pin and dst_device.type == "cpu")
        dst.copy_(src, non_blocking=pin)
        synchronize(src_device if src_device.type == "cuda" else dst_device)
        times.append(time.perf_counter() - t0)
        del dst
        malloc_trim()  # as offload does: the next allocation gets fresh pages, as the engine's do
    return statistics.median(times[1:])


def build_trainer(model_name: str, device: torch.device, seed: int = 0) -> TrainingEngine:
    """The model of ``model_name`` with Muon+AdamW state after one optimizer step on random tokens."""
    torch.manual_seed(seed)
    cfg = MODELS[model_name]
    model = CausalLM(cfg).to(device)
    engine = TrainingEngine(model, build_optimizers(model, "muon", 1e-3, 0.1), pad_id=0)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, cfg.vocab_size, (4, 64), generator=g).tolist()
    lp, mask = engine.response_logprobs([r[:32] for r in ids], [r[32:] for r in ids], 1.0)
    (-lp.sum() / mask.sum()).backward()
    engine.step()
    return engine


def measure(model_name: str, repeats: int = 5, device: str | None = None) -> dict:
    """One benchmark record."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    engine = build_trainer(model_name, dev)
    engine.offload()  # warm-up: first-time allocations (and, on CUDA, pinning the host buffer)
    engine.onload()
    off, on, freed = [], [], []
    nbytes = 0
    for _ in range(repeats):
        synchronize(dev)
        before = rss_bytes()
        stats = engine.offload()
        freed.append(before - rss_bytes())
        off.append(stats["seconds"])
        nbytes = stats["bytes"]
        on.append(engine.onload()["seconds"])
    host = torch.device("cpu")
    copy_s = copy_seconds(nbytes, host, dev, repeats)
    copy_d2h_s = copy_s if dev.type == "cpu" else copy_seconds(nbytes, dev, host, repeats)
    offload_s, onload_s = statistics.median(off), statistics.median(on)
    return {
        "model": model_name,
        "bytes": nbytes,
        "offload_s": round(offload_s, 5),
        "onload_s": round(onload_s, 5),
        "copy_s": round(copy_s, 5),
        "offload_ratio": round(offload_s / copy_d2h_s, 3),
        "onload_ratio": round(onload_s / copy_s, 3),
        "rss_freed_mib": round(statistics.median(freed) / 2**20, 2),
        "device": str(dev),
        "copy_d2h_s": round(copy_d2h_s, 5),
        "params": sum(p.numel() for p in engine.model.parameters()),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.offload", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--repeats", type=int, default=5, help="timed offload/onload cycles after a warm-up one")
    ap.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--json", action="store_true", help="print only the JSON record")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    rec = measure(a.model, a.repeats, a.device)
    if not a.json:
        print(f"{a.model} model ({rec['params']:,} parameters) on {rec['device']}: {rec['bytes'] / 2**20:.1f} MiB "
              f"of weights and optimizer state")
        print(f"offload {rec['offload_s'] * 1e3:.1f} ms ({rec['offload_ratio']:.2f}x a plain copy), onload "
              f"{rec['onload_s'] * 1e3:.1f} ms ({rec['onload_ratio']:.2f}x a plain copy of "
              f"{rec['copy_s'] * 1e3:.1f} ms); RSS freed by offload {rec['rss_freed_mib']} MiB")
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
