"""Each decoder layer's forward compiled on its own (torch.compile): ``trainer.compile`` (before FSDP2 wraps it) and
``rollout.compile`` (the native inference engine's model, before its decode steps are captured as CUDA graphs).

What a layer compiles to is the same for every layer (their parameters are inputs of one graph, not constants), so
a model of any depth compiles a layer's graphs once. The attention core stays out of the graph, eager: document
masks and their caches, max-logit tracking (QK-Clip's signal, a side effect) and flex_attention, which keeps its own
compiled kernel and its fallback to SDPA (``engines.model.native.attention``); in the inference engine the paged
KV cache's attention (``cache.attend``: its kernels, its Python bookkeeping), so a layer is two graphs around it, as
vLLM splits its piecewise-compiled forward. A mixture-of-experts block stays
eager too (its experts run on data-dependent token counts). The graphs hold the rest: the norms, the projections
before and after attention, RoPE, the residual adds and a dense SwiGLU block, where compiling fuses the element-wise
work between the matmuls. Shapes are dynamic from the start, so the varying micro-batches of RL compile once per
grad mode rather than once per shape.

Compiled artifacts are cached on disk (inductor's FX graphs, Triton's kernels) in a persistent per-user directory
unless ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` say otherwise, so later processes (the next run, every
rank) load rather than compile them again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

#: the environment variables inductor and Triton read their on-disk caches from, and their folders in ours
CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def compile_cache_root() -> Path:
    """Where compiled artifacts persist: ``compile/`` in the project's per-user cache (``$RL_CACHE_DIR``, else
    ``~/.cache/rl-colocated``, as the warm-start cache)."""
    root = os.environ.get("RL_CACHE_DIR") or Path.home() / ".cache" / "rl-colocated"
    return Path(root) / "compile"


def _torch_default(value: str) -> bool:
    """Whether ``value`` is torch's own temporary default (``/tmp/torchinductor_<user>``, or Triton's folder in it),
    which importing ``torch._dynamo`` writes into ``TORCHINDUCTOR_CACHE_DIR`` (and a first Triton kernel into
    ``TRITON_CACHE_DIR``) whether or not anyone chose it."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # the private helper moved: only an unset variable counts as unset
        return False
    default, path = os.path.abspath(default_cache_dir()), os.path.abspath(value)
    return path == default or path.startswith(default + os.sep)


def use_compile_cache() -> dict[str, str]:
    """Point inductor and Triton at the persistent cache where the environment names none of its own (unset, or
    torch's temporary default: ``_torch_default``), before anything compiles: both look the variables up when they
    need the cache. Returns the variables' values."""
    root = compile_cache_root()
    for var, sub in CACHE_ENV.items():
        value = os.environ.get(var)
        if not value or _torch_default(value):
            path = root / sub
            path.mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(path)
    return {var: os.environ[var] for var in CACHE_ENV}


def _layers(model: nn.Module) -> list[nn.Module] | None:
    """The native model's decoder layers, or None for a model whose layers this does not know how to split."""
    from engines.model.native.causal_lm import CausalLM

    return list(model.model.layers) if isinstance(model, CausalLM) else None


def compile_layers(model: nn.Module, dynamic: bool = True) -> int:
    """Compile the forward of each decoder layer of native ``model`` in place (parameter names, hooks and the
    state dict unchanged: the compiled forward is an attribute of the layer, around which FSDP2's hooks still run
    eagerly); returns how many layers. The attention core (``_attend``, ``_attend_latent``) and MoE blocks run eagerly
    inside it (module docstring). A transformers-backed model is left as it is (0), with a warning. Idempotent."""
    from engines.model.native.causal_lm import ATTENTION_TYPES
    from engines.model.native.moe import MoE

    layers = _layers(model)
    if layers is None:
        log.warning("compile: %s is not the native model; its layers run eagerly", type(model).__name__)
        return 0
    use_compile_cache()
    for layer in layers:
        if getattr(layer, "_layer_compiled", False):
            continue
        for m in layer.modules():
            if isinstance(m, ATTENTION_TYPES):
                m._attend = torch.compiler.disable(m._attend)
                if hasattr(m, "_attend_latent"):  # latent attention over the inference engine's cache
                    m._attend_latent = torch.compiler.disable(m._attend_latent)
            elif isinstance(m, MoE):
                m.forward = torch.compiler.disable(m.forward)
        layer.forward = torch.compile(layer.forward, dynamic=dynamic)
        layer._layer_compiled = True
    return len(layers)


def is_compiled(layer: nn.Module) -> bool:
    """Whether ``compile_layers`` compiled ``layer``."""
    return bool(getattr(layer, "_layer_compiled", False))
