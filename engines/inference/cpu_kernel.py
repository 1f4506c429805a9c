"""The native engine's CPU decode-attention kernel (``csrc/paged_decode.cpp``), built on first use.

Each decoding sequence's keys and values are read in place through its block table (see the C++ file), which on
a CPU is about 1.5x faster than the torch path's gather and matmuls over one decode step of the quick-start model
and removes the gather's scratch buffers. The kernel is compiled once per machine by PyTorch's extension loader
(a C++ compiler, the Python headers and ninja; cached under ``TORCH_EXTENSIONS_DIR``), under a lock that a killed
build cannot leave behind (``engines.inference.extension_build``). Where it cannot be built the engines fall back
to the torch path after one warning; ``COLOCATED_RL_CPU_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from engines.inference.extension_build import load_extension

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
#: -ffast-math lets the compiler vectorise the softmax's exp and the dot products' sums; the kernel is written
#: without infinities, and only the compile step gets the flag (linking it would set flush-to-zero process-wide).
CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]
#: Instruction sets by the CPU capability torch detects, named in the build's name: a cache directory shared by
#: machines of different CPUs (a home on a network volume) never hands one a build it cannot run, as
#: -march=native could.
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
             "AVX2": ["-mavx2", "-mfma"]}


@cache
def _module() -> ModuleType | None:
    if os.environ.get("COLOCATED_RL_CPU_KERNEL", "1") == "0":
        return None
    try:
        isa = torch.backends.cpu.get_cpu_capability()
        return load_extension(f"colocated_rl_paged_decode_{isa.lower()}", SOURCE, CFLAGS + ISA_FLAGS.get(isa, []),
                              ["-fopenmp"])
    except Exception as e:  # no compiler, no headers, no ninja: decode still works, through the gather
        log.warning("the CPU decode-attention kernel could not be built (%s); decoding gathers each sequence's "
                    "blocks instead", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def available() -> bool:
    """Whether the kernel is built (building it on the first call, ~20 s once per machine)."""
    return _module() is not None


def paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                 positions: torch.Tensor, block_size: int, scale: float, window: int | None,
                 new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None) -> torch.Tensor:
    """Attention [S, H, Dv] of one query per sequence, q [S, H, D], over one layer's pool: keys [KVH, rows, D],
    values [KVH, rows, Dv] (row-contiguous views, e.g. the keys' first Dv dimensions); ``table`` [S, B] block ids,
    ``positions`` [S]: sequence s sees its keys 0..positions[s] (the last ``window`` of them when given).
    ``new_keys`` [S, KVH, D] / ``new_values`` [S, KVH, Dv]: each sequence's key/value at its position, written
    into the pool first (values only where they have a pool of their own)."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the CPU decode-attention kernel is not available (see the warning logged at its build)")
    return mod.paged_decode(q.contiguous(), keys, values, table, positions, block_size, scale, window or 0,
                            new_keys, new_values)
