"""The policy a trainer rank holds: built empty in its dtypes, sharded over the ranks, with or without LoRA adapters,
and written out as the weights the replicas serve.

Everything a trainer does differently when it trains adapters on a frozen base (``model.lora``) lives here: the
adapters go on before FSDP2 shards the model (so they are sharded with the base and their gradients alone are
reduced), a QLoRA base is quantized once the start-up read filled it, and a saved or served state is the base with the
adapters merged, the adapters also in PEFT's format beside it. The controller's worker only calls these.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engines.model import sharded
from engines.model.io.hf_io import read_tensors, save_pretrained
from engines.model.lora.adapters import (
    ADAPTER_DIR,
    LoraSpec,
    apply_lora,
    init_adapters,
    is_adapter,
    merged_state,
    save_adapters,
)
from engines.model.lora.quant import exact_base, quantize_base, quantized_weights
from engines.model.native.causal_lm import build_model
from engines.model.native.compile import compile_layers
from engines.training import distributed
from engines.training.parallel_dims import ParallelDims

LORA_SEED = 0  # LoRA's A matrices: the same draw on every rank and in every run (B starts at zero)


@dataclass(frozen=True, kw_only=True)
class PolicySpec:
    """How a rank holds the policy: the model code (``backend``: "native" or "transformers"), master and compute
    dtypes, the replicas' dtype (``served_dtype``), whether transformers may run the model's own code, the LoRA
    adapters it trains (None: every weight), whether each decoder layer's forward is compiled
    (``engines.model.native.compile``) and whether a vision-language model's vision side stays frozen."""

    backend: str = "native"
    master_dtype: str = "float32"
    compute_dtype: str = "float32"
    served_dtype: str = "float32"
    trust_remote_code: bool = False
    lora: LoraSpec | None = None
    compile: bool = False
    freeze_vision: bool = False  # a vision-language model: its vision tower and projector are not trained

    def sharded(self, world: int) -> bool:
        """Whether the model is sharded with FSDP2: over several ranks, or on one for mixed precision (LoRA on one
        rank needs none: its frozen model is kept in the compute dtype)."""
        return world > 1 or (self.compute_dtype != self.master_dtype and self.lora is None)


def empty_policy(arch, spec: PolicySpec, dims: ParallelDims, device: str, lora: LoraSpec | None = None) -> nn.Module:
    """An empty model of ``arch`` in the master dtype, sharded over ``dims``' mesh where the spec shards it (FSDP2,
    compute in the compute dtype), for the start-up read to fill. The transformers backend builds transformers' own
    model (``HFCausalLM``) under the same contract. ``lora`` (sharded only): the adapters go on before sharding and are
    drawn once sharded, A alike on every rank (each keeps its rows). With ``spec.compile`` the decoder layers'
    forwards are compiled (``engines.model.native.compile``) before FSDP2 wraps the layers."""
    from engines.model.hf.backend import empty_hf_model, materialize

    dtype = getattr(torch, spec.master_dtype)
    shard = spec.sharded(dims.world)
    if spec.backend == "transformers":
        model = empty_hf_model(arch, dtype, spec.trust_remote_code)
        if not shard:
            materialize(model, device)
    else:
        model = build_model(arch, device="meta" if shard else device, dtype=dtype)
    if spec.compile:
        compile_layers(model)
    if not shard:
        return model
    if lora is not None:
        apply_lora(model, lora, dtype)  # on meta: the adapters' shapes
    mesh = dims.build_mesh(torch.device(device).type)
    model = distributed.shard_model(model, param_dtype=spec.compute_dtype, device=device, mesh=mesh,
                                    expert_mesh=dims.build_expert_mesh(torch.device(device).type))
    if lora is not None:
        init_adapters(model, lora, torch.Generator(device=device).manual_seed(LORA_SEED))
    return model


def build_policy(arch, spec: PolicySpec, dims: ParallelDims, device: str) -> nn.Module:
    """The rank's empty policy (``empty_policy``); on one unsharded rank with LoRA, the base frozen in the compute
    dtype (or, under float32 compute, kept in the replicas' narrower dtype: nothing is lost, the checkpoint's own)
    and the adapters in the master dtype."""
    shard = spec.sharded(dims.world)
    model = empty_policy(arch, spec, dims, device, spec.lora)
    if spec.freeze_vision:
        from engines.model.hf.spec import vision_modules

        towers = vision_modules(model)
        if not towers:
            raise ValueError("model.freeze_vision: the model has no vision tower (a text-only model)")
        for m in towers:
            m.requires_grad_(False)
    if spec.lora is not None and not shard:
        master, served = getattr(torch, spec.master_dtype), getattr(torch, spec.served_dtype)
        if spec.compute_dtype != spec.master_dtype:  # the checkpoint's dtype (checked by the settings)
            model.to(getattr(torch, spec.compute_dtype))
        apply_lora(model, spec.lora, master, torch.Generator(device=device).manual_seed(LORA_SEED),
                   base_dtype=served if served.itemsize < master.itemsize else None)
    return model


def after_startup(model: nn.Module, spec: PolicySpec) -> None:
    """What follows the start-up read's fill: a QLoRA base quantized, once."""
    if spec.lora is not None and spec.lora.quantize_base is not None:
        quantize_base(model, spec.lora.quantize_base)


def served_state(model: nn.Module, spec: PolicySpec, state: dict[str, torch.Tensor],
                 model_dir: str) -> dict[str, torch.Tensor]:
    """A full ``state`` of ``model`` (gathered) as the policy the replicas serve: with LoRA the base plus adapters
    merged, the base of a quantized projection (QLoRA) read from ``model_dir``, the checkpoint the run started from,
    as the replicas keep it."""
    if spec.lora is None:
        return state
    quantized = quantized_weights(model)
    if quantized:
        state = exact_base(state, quantized, read_tensors(model_dir, quantized))
    return merged_state(state, spec.lora.scaling)


def save_policy(model: nn.Module, spec: PolicySpec, directory: str, model_dir: str) -> None:
    """The policy in Hugging Face format in ``directory`` (rank 0 writes the gathered tensors): with LoRA the merged
    model, which loads as the trained policy, and ``adapter/`` in PEFT's format for the base. Collective (the caller
    waits for rank 0 to be done)."""
    state = sharded.full_state_dict(model)
    if distributed.rank() == 0:
        if spec.lora is not None:
            adapters = {n: v for n, v in state.items() if is_adapter(n)}  # gathered whole
            save_adapters(spec.lora, adapters, Path(directory) / ADAPTER_DIR, base_model=model_dir)
        save_pretrained(model, None, directory, state=served_state(model, spec, state, model_dir))
    del state
