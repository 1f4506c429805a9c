"""What each rollout engine can do, declared once and readable without importing the engine.

The controller decides whether a run's config can be served (``rl.settings.resolve``, and the config's own
validation where it names an engine) and ``EngineSettings`` checks a replica's settings by reading these
declarations, never by probing an engine or repeating what it supports. The table lives here, keyed by the
engine's kind, so that a driver without vLLM installed reads vLLM's declaration too; each engine class points at
its entry (``RolloutEngine.capabilities``).

    capabilities_of("vllm").fp8            # False: block-FP8 replicas are the native engine's
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.inference.vllm_setup import CPU_MOE_UNSUPPORTED

__all__ = ["CAPABILITIES", "EngineCapabilities", "capabilities_of", "kinds_with"]


@dataclass(frozen=True, kw_only=True)
class EngineCapabilities:
    """What one engine kind supports.

    ``tensor_parallel``: a replica may span several devices (tensor parallel, and expert parallel over its ranks);
    ``fp8``: block-FP8 replicas; ``lora_updates``: how a LoRA run's adapter updates can reach a replica ("merged":
    W0 + s·B·A written into its weights, "unmerged": low-rank deltas beside the base); ``lora_tensor_parallel``:
    those updates reach every rank of a replica spanning devices; ``sleep_levels``: what ``sleep`` takes;
    ``cpu_moe_unsupported``: (model type, why) of the MoE models whose experts a CPU replica cannot run at all
    (whether an update reaches a family's experts in place is measured by each replica as it starts,
    ``engines.inference.replica_check``, not declared); ``prompt_logprobs``: scores a prompt's tokens; ``cuda_graphs``:
    captures decode steps on a GPU; ``ipc_views``: loads updates from views of the checkpoint engine's IPC buffers;
    ``routing_capture``: MoE expert choices reported with the tokens (``record_routes``); ``multimodal_inputs``: prompts
    with images (``add_request(images=)``, a vision-language model's template ids);
    ``step_top_logprobs``: serves ``SamplingParams.top_logprobs``, the model's own alternatives (temperature 1, no
    filters) from the decode step that sampled each token (vLLM's step alternatives would be at the request's
    temperature and filters: a server scores its tokens instead); ``multi_step_decode``: runs several decode
    forwards per host read (``decode_steps``; vLLM schedules its own steps); ``compiled_layers``: the model's layers
    compiled on request (``rollout.compile``; vLLM compiles its own).
    """

    kind: str
    tensor_parallel: bool
    fp8: bool
    lora_updates: tuple[str, ...]
    lora_tensor_parallel: bool
    sleep_levels: tuple[int, ...]
    cpu_moe_unsupported: tuple[tuple[str, str], ...]
    prompt_logprobs: bool
    cuda_graphs: bool
    ipc_views: bool
    multimodal_inputs: bool = False
    routing_capture: bool = False
    step_top_logprobs: bool = False
    multi_step_decode: bool = False
    compiled_layers: bool = False

    def moe_unsupported(self, model_type: str, device: str) -> str | None:
        """Why a replica on ``device`` cannot serve the experts of a ``model_type`` model (None: it can, or the
        replica's start-up check will say)."""
        return dict(self.cpu_moe_unsupported).get(model_type) if device == "cpu" else None


NATIVE = EngineCapabilities(kind="native", tensor_parallel=False, fp8=True, lora_updates=("merged", "unmerged"),
                            lora_tensor_parallel=False, sleep_levels=(1, 2), cpu_moe_unsupported=(),
                            prompt_logprobs=True, cuda_graphs=True, ipc_views=False, step_top_logprobs=True,
                            routing_capture=True, multi_step_decode=True, compiled_layers=True)
# vLLM's CPU build runs no non-gated experts (engines.inference.vllm_setup); a LoRA run's merged weights reach one
# rank of its replica, so LoRA runs on vLLM stay on one device
VLLM = EngineCapabilities(kind="vllm", tensor_parallel=True, fp8=False, lora_updates=("merged",),
                          lora_tensor_parallel=False, sleep_levels=(1, 2), cpu_moe_unsupported=CPU_MOE_UNSUPPORTED,
                          prompt_logprobs=True, cuda_graphs=True, ipc_views=True, multimodal_inputs=True,
                          routing_capture=True)  # its own capture, where the build has it (vllm_routes)

#: every engine kind's declaration (``rollout.engine``'s values but "auto")
CAPABILITIES: dict[str, EngineCapabilities] = {c.kind: c for c in (NATIVE, VLLM)}


def capabilities_of(kind: str) -> EngineCapabilities:
    """The declaration of engine ``kind`` (ValueError in one line for an unknown kind); vLLM is not imported."""
    try:
        return CAPABILITIES[kind]
    except KeyError:
        raise ValueError(f"no rollout engine {kind!r}: the engines are {', '.join(CAPABILITIES)}") from None


def kinds_with(capability: str) -> list[str]:
    """The engine kinds whose declaration has ``capability`` (a boolean field) set."""
    return [k for k, c in CAPABILITIES.items() if getattr(c, capability)]
