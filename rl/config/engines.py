"""A run's config checked against what its rollout engine declares it supports (``engines.inference.capabilities``).

``check_engine`` is the one place where a config is refused for asking an engine what it cannot do: tensor parallel
replicas, FP8, how LoRA updates reach the replica, sleep levels, MoE layers a CPU build cannot run (whether its
in-place updates reach a family's experts, each vLLM replica measures as it starts:
``engines.inference.replica_check``). ``rl.settings.resolve`` calls it once the engine is chosen; the config's
validation calls it too where ``rollout.engine`` names the engine (the replica's devices are the config's alone to
decide, so that is refused as it is read). Nothing here imports vLLM or
torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines.inference.capabilities import capabilities_of
from rl.errors import UserError

if TYPE_CHECKING:
    from rl.config import Config


def check_engine(cfg: Config, kind: str, why: str, *, backend: str | None = None, sleep_level: int = 0,
                 moe_model_type: str | None = None) -> None:
    """Refuse ``cfg`` in one line (UserError) where it asks the ``kind`` engine (chosen: ``why``) for something its
    declaration lacks. ``backend``: the trainer's model code as resolved; None (the config's validation, before the
    model is read) checks the replica's devices only, and the rest waits for resolve. ``sleep_level``: the level the
    run sleeps at, resolved (0: never); ``moe_model_type``: the model's type where its layers build experts (None:
    dense)."""
    caps, r, lora = capabilities_of(kind), cfg.rollout, cfg.model.lora
    tp = r.tensor_parallel_size
    if tp > 1 and not caps.tensor_parallel:
        if cfg.rollout.engine == kind:
            raise UserError(f"rollout.tensor_parallel_size={tp} needs rollout.engine: vllm (a native replica is one "
                            "device)")
        raise UserError(f"rollout.tensor_parallel_size={tp} needs vLLM, and rollout.engine resolved to {kind} "
                        f"({why}); set rollout.engine: vllm and install vLLM")
    if r.decode_steps > 1 and not caps.multi_step_decode:
        raise UserError(f"rollout.decode_steps={r.decode_steps} is the native engine's multi-step decoding, and "
                        f"rollout.engine resolved to {kind} ({why}), which schedules its own steps: leave it at 1 "
                        "or set rollout.engine: native")
    if r.compile and not caps.compiled_layers:
        raise UserError(f"rollout.compile is the native engine's compiled layers, and rollout.engine resolved to "
                        f"{kind} ({why}), which compiles its own model: leave it off or set rollout.engine: native")
    if backend is None:
        return
    if r.fp8 and not caps.fp8:
        raise UserError("rollout.fp8 is served by the native engine only" +
                        (", which does not run the transformers backend" if backend == "transformers" else
                         "; set rollout.engine: native"))
    device = "cuda" if cfg.cluster.gpus_per_worker > 0 else "cpu"
    why_not = None if moe_model_type is None else caps.moe_unsupported(moe_model_type, device)
    if why_not is not None:  # measured: docs/models.md, "MoE models"
        from engines.model.native.arch import FAMILIES

        raise UserError(f"rollout.engine {kind} on CPU workers cannot run the MoE layers of {moe_model_type}: "
                        f"{why_not}; " + ("set rollout.engine: native" if moe_model_type in FAMILIES else
                                          "this model rolls out on GPU workers only"))
    if sleep_level and sleep_level not in caps.sleep_levels:
        raise UserError(f"rollout.sleep_level {sleep_level}: the {kind} engine sleeps at levels "
                        f"{', '.join(map(str, caps.sleep_levels))} (or 0: never)")
    if lora is None:
        return
    if not caps.lora_updates:
        raise UserError(f"model.lora: the {kind} rollout engine takes no LoRA updates; set rollout.engine: native")
    if lora.unmerged and "unmerged" not in caps.lora_updates:
        raise UserError("model.lora.unmerged needs the native rollout engine: vLLM's replicas merge the adapters "
                        "into their weights; set model.lora.unmerged: false (or rollout.engine: native)")
    if tp > 1 and not caps.lora_tensor_parallel:
        raise UserError("model.lora with vLLM: the merged weights reach a replica of one rank only; set "
                        "rollout.tensor_parallel_size: 1 (or rollout.engine: native)")
