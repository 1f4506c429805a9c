"""The experts vLLM's MoE layers chose for each token, as routing replay needs them (``Completion.routed_experts``).

vLLM returns them itself where it can (``enable_return_routed_experts``, its ``AuxOutputConfig``): for a finished
request, one row per token it computed (prompt and response, all but the last), ``[tokens, decoder layers, top_k]``
with every decoder layer's slot, dense ones included. The native engine and the trainer number the MoE layers only,
so the rows keep those. Its capture runs in vLLM's Model Runner V2, which needs Triton: a GPU build (or a CPU one
with triton-cpu installed). A request that is aborted (paused by partial rollout) comes back without routes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence

import numpy as np

#: the option that turns vLLM's capture on, and the environment variable that selects its Model Runner V2
OPTION, RUNNER_V2_ENV = "enable_return_routed_experts", "VLLM_USE_V2_MODEL_RUNNER"


def routes_unsupported(device: str) -> str | None:
    """Why the installed vLLM cannot return routes on ``device`` (None: it can; a GPU build's Triton is checked by
    vLLM when it starts). Imports vLLM."""
    from vllm import __version__
    from vllm.engine.arg_utils import EngineArgs

    if OPTION not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return f"vLLM {__version__} cannot return MoE routes (it has no {OPTION}); install a newer vLLM"
    if device == "cpu" and not _has_triton():
        return ("vLLM returns MoE routes only from its Model Runner V2, which needs Triton: a GPU build "
                "(or triton-cpu); use rollout.engine: native")
    return None


def _has_triton() -> bool:
    """Whether vLLM itself finds a working Triton (a Triton without this device's backend counts as none)."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return importlib.util.find_spec("triton") is not None
    return bool(HAS_TRITON)


def moe_routes(raw, moe_layers: Sequence[int]) -> np.ndarray:
    """vLLM's routes of one request [tokens, decoder layers, k] as the native engine's [tokens, MoE layers, k]
    (int32); ValueError in one line when a finished request came back without them or in another shape."""
    if raw is None:
        raise ValueError("vLLM returned no routes for a finished request (enable_return_routed_experts is off?)")
    routes = np.asarray(raw)
    if routes.ndim != 3 or (moe_layers and routes.shape[1] <= max(moe_layers)):
        raise ValueError(f"vLLM's routes have shape {routes.shape}, not [tokens, decoder layers, top_k] of a model "
                         f"whose MoE layers are {list(moe_layers)}")
    return np.ascontiguousarray(routes[:, list(moe_layers), :]).astype(np.int32)
