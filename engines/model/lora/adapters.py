"""LoRA: low-rank adapters on the linear layers of either model backend (the native model, or transformers' own
modules inside ``engines.model.hf.backend.HFCausalLM``), in PEFT's conventions.

A target projection W [out, in] gains ``lora_A`` [r, in] and ``lora_B`` [out, r] and computes
W·x + (alpha/r)·B·A·dropout(x); W (and its bias) stay frozen, B starts at zero so the adapted model starts as the
base. ``LoraLinear`` is an ``nn.Linear`` subclass that keeps W under its own name (``q_proj.weight``): loading,
saving, sharding and the checkpoint engine's placements see the base as before, and the adapters appear beside it as
``q_proj.lora_A.weight`` / ``q_proj.lora_B.weight``, PEFT's names less its ``base_model.model.`` prefix. (PEFT's own
``get_peft_model`` would move W to ``q_proj.base_layer.weight``, which every name-keyed path here would have to undo.)

Targets are chosen by the projections' names (``q_proj`` ... ``down_proj``) inside the decoder layers; stacked MoE
experts are not ``nn.Linear`` and are never adapted, and MLA's projections (DeepSeek-V3, Kimi K2) are refused by
``check_lora``, as is a transformers model whose adapted weight its checkpoint stores under another name.
``save_adapters`` writes what ``peft.PeftModel.from_pretrained`` loads on top of the Hugging Face base model;
``merge_adapters_into`` (the one merge) and ``AdapterMerger`` fold adapters into a frozen base exactly (from the base
copy each time, so rounding never accumulates over updates); ``adapter_pairs`` is the one reading of adapter names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engines.model.layout import is_adapter
from engines.model.lora.quant import QUANT_KINDS, base_linear
from engines.model.native.arch import MLA_FAMILIES, ModelConfig

#: The default targets: the attention projections and the dense MLP's three.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
INITS = ("kaiming", "gaussian")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_DIR = "adapter"  # a LoRA run's checkpoint or final/: its adapters in PEFT's format, beside the merged model
#: What PEFT puts before a causal LM's own parameter names in its saved adapters.
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of a run: rank r, alpha (scaling alpha/r), dropout on the adapters' input, the target
    projections' names, and A's initialisation ("kaiming": PEFT's default uniform; "gaussian": N(0, 1/r))."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    init: str = "kaiming"
    quantize_base: str | None = None  # QLoRA: the adapted projections' frozen weights quantized in the trainer

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.init not in INITS:
            raise ValueError(f"LoRA init must be one of {INITS}, got {self.init!r}")
        if self.quantize_base is not None and self.quantize_base not in QUANT_KINDS:
            raise ValueError(f"LoRA quantize_base must be one of {QUANT_KINDS} or None, got {self.quantize_base!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class _NarrowBaseLinear(torch.autograd.Function):
    """x·Wᵀ (+ b) for a frozen W stored narrower than x (a bfloat16 base under float32 compute): W is widened for
    the product and again for the backward's x-gradient, so autograd keeps the narrow W, never a wide copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None


class LoraLinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update (``lora_A``, ``lora_B``, ``scaling``). The frozen
    weight may be stored in a narrower dtype than the input (``apply_lora``'s ``base_dtype``): the product is then
    computed in the input's dtype, as with a widened copy, without keeping one."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:  # QLoRA: the base was quantized (engines.model.lora.quant)
            out = base_linear(self, x)
        elif self.weight.dtype == x.dtype:
            out = F.linear(x, self.weight, self.bias)
        else:
            out = _NarrowBaseLinear.apply(x, self.weight, self.bias)
        h = self.lora_dropout(x)
        a, b = self.lora_A.weight, self.lora_B.weight
        if a.dtype != h.dtype:
            # adapters wider than the compute (float32 under bfloat16): cast the rank-r weights, not the input, as
            # mixed precision does for any weight; casting x kept a float32 copy of every adapted input for the
            # backward (1.9 GiB more than full training's peak on the 0.6 B shape, H200 lease of 2026-11-28)
            a, b = a.to(h.dtype), b.to(h.dtype)
        return out + F.linear(F.linear(h, a), b) * self.scaling


def lora_targets(model: nn.Module, names: tuple[str, ...] | list[str]) -> list[str]:
    """Paths of the ``nn.Linear`` modules inside ``model``'s decoder layers whose own name is one of ``names``."""
    want = set(names)
    return [path for path, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".layers." in f".{path}" and path.rpartition(".")[2] in want
            and not path.endswith((".lora_A", ".lora_B"))]


def empty_model(cfg) -> nn.Module:
    """A model of ``cfg`` on the meta device: the native architecture's, or transformers' own for a model the
    transformers backend runs (``engines.model.hf.spec.ModelDescription``)."""
    if getattr(cfg, "backend", "native") == "transformers":
        from engines.model.hf.backend import empty_hf_model

        # a description of a model with its own code exists only if its code was trusted when it was read
        return empty_hf_model(cfg.hf_config, trust_remote_code=bool(getattr(cfg.hf_config, "auto_map", None)))
    from engines.model.native.causal_lm import build_model

    return build_model(cfg, device="meta")


def check_lora(cfg, spec: LoraSpec, model: nn.Module | None = None) -> list[str]:
    """The module paths ``spec`` adapts in a model of ``cfg`` (a native ``ModelConfig`` or a transformers
    ``ModelDescription``; built on meta when ``model`` is None); ValueError in one line for MLA, a name that adapts
    nothing (experts, a typo) or a fused (inference) layout."""
    if cfg.model_type in MLA_FAMILIES or getattr(cfg, "is_mla", False):
        raise ValueError(f"LoRA on {cfg.model_type} is not supported: its latent attention (MLA) projections are not "
                         "adapted yet; train it without LoRA")
    if model is None:
        model = empty_model(cfg)
    if getattr(model, "fused", False):
        raise ValueError("LoRA adapts the trainer's layout, not the fused inference layout")
    found = lora_targets(model, spec.target_modules)
    have = {p.rpartition(".")[2] for p in found}
    missing = [n for n in spec.target_modules if n not in have]
    if missing:
        linear = sorted({p.rpartition(".")[2] for p in lora_targets(model, _all_leaf_names(model))})
        moe = cfg.is_moe if isinstance(cfg, ModelConfig) else cfg.num_experts > 0
        experts = " (the MoE layers' experts are stacked tensors, not adapted)" if moe and \
            set(missing) & set(MLP_TARGETS) else ""
        raise ValueError(f"LoRA target module(s) {', '.join(map(repr, missing))} match no linear layer of this "
                         f"{cfg.model_type} model{experts}; its decoder layers have: {', '.join(linear)}")
    own = getattr(model, "checkpoint_placements", None)  # a transformers model: its checkpoint's names
    if own is not None:
        # the adapters travel and are saved under the module's names, and a replica merges them into the checkpoint
        # tensor of that name: a weight transformers renames or converts on loading has no such tensor
        whole = {p.target for n, p in own().items() if n == p.target and p.offset == 0}
        renamed = [p for p in found if f"{p}.weight" not in whole]
        if renamed:
            raise ValueError(f"LoRA on {cfg.model_type}: its checkpoint stores {renamed[0]}.weight under another name "
                             f"or layout (transformers converts it on loading), which adapters by module name cannot "
                             f"update; train it without LoRA or with target_modules that exclude it")
    return found


def _all_leaf_names(model: nn.Module) -> list[str]:
    return [p.rpartition(".")[2] for p, m in model.named_modules() if isinstance(m, nn.Linear)]


def default_targets(cfg, model: nn.Module | None = None) -> tuple[str, ...]:
    """``DEFAULT_TARGETS`` a model of ``cfg`` (``model``, else one built on meta) has as linear layers (an MoE model
    without dense layers: attention)."""
    have = {p.rpartition(".")[2] for p in lora_targets(model if model is not None else empty_model(cfg),
                                                        DEFAULT_TARGETS)}
    return tuple(n for n in DEFAULT_TARGETS if n in have)


@torch.no_grad()
def init_adapters(model: nn.Module, spec: LoraSpec, generator: torch.Generator | None = None) -> None:
    """A per ``spec.init`` (kaiming: PEFT's uniform with a=√5; gaussian: N(0, 1/r)), B zero, in every adapter. Each A
    is drawn whole from ``generator`` and a sharded one (FSDP2) keeps its own rows: the same adapters whatever the
    number of ranks."""
    from engines.model.sharded import local_rows, local_tensor

    for m in model.modules():
        if isinstance(m, LoraLinear):
            a = m.lora_A.weight
            local, first = local_rows(a)
            full = torch.empty(a.shape, dtype=a.dtype, device=local.device)
            if spec.init == "gaussian":
                full.normal_(0.0, 1.0 / spec.rank, generator=generator)
            else:  # kaiming_uniform_(a=√5): bound 1/√fan_in
                bound = 1.0 / math.sqrt(a.shape[1])
                full.uniform_(-bound, bound, generator=generator)
            with torch.no_grad():
                local.copy_(full[first:first + local.shape[0]])
                local_tensor(m.lora_B.weight).zero_()


def apply_lora(model: nn.Module, spec: LoraSpec, adapter_dtype: torch.dtype = torch.float32,
               generator: torch.Generator | None = None, base_dtype: torch.dtype | None = None) -> list[str]:
    """Freeze every parameter of ``model`` and turn each target projection into a ``LoraLinear`` (same weight and
    bias tensors, adapters in ``adapter_dtype`` on the base's device, initialised by ``init_adapters``); returns the
    adapted paths. A meta-device model gets meta adapters (initialise them after ``to_empty``). ``base_dtype``:
    the adapted projections' frozen weights are kept in this dtype (the checkpoint's, so nothing is lost, e.g.
    bfloat16 under float32 compute: half the bytes of most of the model)."""
    cfg = model.config
    paths = check_lora(cfg, spec, model)
    for p in model.parameters():
        p.requires_grad_(False)
    for path in paths:
        lin = model.get_submodule(path)
        lin.__class__ = LoraLinear  # keeps weight, bias and hooks: the base is not copied
        if base_dtype is not None and lin.weight.dtype != base_dtype:
            lin.weight = nn.Parameter(lin.weight.detach().to(base_dtype), requires_grad=False)
        dev = lin.weight.device
        lin.lora_A = nn.Linear(lin.in_features, spec.rank, bias=False, device=dev, dtype=adapter_dtype)
        lin.lora_B = nn.Linear(spec.rank, lin.out_features, bias=False, device=dev, dtype=adapter_dtype)
        lin.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        lin.scaling = spec.scaling
    if next(model.parameters()).device.type != "meta":
        init_adapters(model, spec, generator)
    model.lora = spec
    return paths


def adapter_state(model: nn.Module, full: bool = False) -> dict[str, torch.Tensor]:
    """The adapters' tensors by the model's names (detached; DTensor shards stay shards unless ``full``, which
    gathers them: collective, every rank must call it)."""
    from torch.distributed.tensor import DTensor

    return {n: p.detach().full_tensor() if full and isinstance(p, DTensor) else p.detach()
            for n, p in model.named_parameters() if is_adapter(n)}


#: Rows of one merge block: float32 temporaries of about this many bytes (one fused product-and-add per block
#: instead of five full-size passes over the weight).
MERGE_BLOCK_BYTES = 16 << 20


LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def adapter_pairs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """The one reading of adapter names: each adapted weight's checkpoint name (``...q_proj.weight``) -> its (A, B)
    among ``tensors`` (``...q_proj.lora_A.weight``, ``...q_proj.lora_B.weight``; None for a factor not there).
    Names that are not an adapter's are left out."""
    pairs: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    for name, t in tensors.items():
        for suffix, slot in ((LORA_A, 0), (LORA_B, 1)):
            if name.endswith(suffix):
                weight = name.removesuffix(suffix) + ".weight"
                pair = list(pairs.get(weight, (None, None)))
                pair[slot] = t
                pairs[weight] = (pair[0], pair[1])
    return dict(sorted(pairs.items()))


def merge_adapters_into(adapters: Mapping[str, torch.Tensor], scaling: float, base: Mapping[str, torch.Tensor],
                        out: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The one merge W0 + scaling·B·A: for each weight ``adapters`` adapt (every adapter, by the trainer's names),
    ``out(name)`` (the tensor to write, which may be the base itself) gets the merge of ``base[name]`` and the
    adapters, computed in float32 on ``out``'s device; yields each (name, tensor written) as it is done."""
    for name, (a, b) in adapter_pairs(adapters).items():
        if name not in base:
            raise ValueError(f"LoRA update: the base has no weight {name}")
        if a is None or b is None:
            raise ValueError(f"LoRA update: {name} lacks lora_{'A' if a is None else 'B'}")
        dst = out(name)
        merge_into(dst, base[name], a.to(dst.device), b.to(dst.device), scaling)
        yield name, dst


def merge_into(out: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
    """``out`` ← W0 + scaling·B·A in ``out``'s dtype, computed in float32 from the base ``base`` (which may be
    ``out`` itself: each block of rows is read before it is written)."""
    a32, b32 = a.float(), b.float()
    rows = max(1, MERGE_BLOCK_BYTES // (4 * base.shape[1]))
    for i in range(0, base.shape[0], rows):
        # a base kept in (pinned) host memory comes to the device a block at a time
        blk = base[i:i + rows].to(out.device, non_blocking=True).float()
        out[i:i + rows].copy_(torch.addmm(blk, b32[i:i + rows], a32, alpha=scaling))


def merged_state(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full state (base and adapters by the model's names) with each adapted ``weight`` merged (in its dtype, from
    the base itself) and the adapter tensors gone: what a plain model of the same family loads."""
    out = {name: t for name, t in state.items() if not is_adapter(name)}
    adapters = {name: t for name, t in state.items() if is_adapter(name)}
    out.update(merge_adapters_into(adapters, scaling, state, lambda name: torch.empty_like(state[name])))
    return out


def peft_config(spec: LoraSpec, base_model: str | None) -> dict:
    """The ``adapter_config.json`` PEFT's ``LoraConfig`` reads for these adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": list(spec.target_modules), "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True if spec.init == "kaiming" else "gaussian", "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "inference_mode": True}


def save_adapters(spec: LoraSpec, adapters: Mapping[str, torch.Tensor], directory: str | Path,
                  base_model: str | None = None) -> Path:
    """Write ``adapters`` (full tensors by the model's names: ``adapter_state``, gathered) in PEFT's format:
    ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's key names."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + n: t.detach().cpu().contiguous() for n, t in adapters.items()}
    save_file(tensors, str(d / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (d / ADAPTER_CONFIG).write_text(json.dumps(peft_config(spec, base_model), indent=2))
    return d


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT LoRA adapter read from disk: its spec (rank, alpha, targets...), the base model it names (PEFT's
    ``base_model_name_or_path``, None where unset) and its tensors by the model's names (``...lora_A.weight``)."""

    spec: LoraSpec
    base_model: str | None
    tensors: dict[str, torch.Tensor]

    @property
    def modules(self) -> list[str]:
        """The adapted modules' paths, sorted (``model.layers.0.self_attn.q_proj``...)."""
        return [w.removesuffix(".weight") for w in adapter_pairs(self.tensors)]


#: PEFT ``init_lora_weights`` values that change the base weights themselves (an adapter saved after one of them
#: is not base + B·A over the original base unless PEFT converted it when saving).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


def _unsupported(c: Mapping) -> str | None:
    """What in a PEFT ``adapter_config.json`` this project cannot serve as W + (alpha/r)·B·A, or None."""
    if c.get("peft_type") != "LORA":
        return f"peft_type {c.get('peft_type')!r} (only LORA adapters are supported)"
    for flag, what in (("use_dora", "DoRA's magnitude vectors"), ("use_rslora", "rsLoRA's alpha/sqrt(r) scaling"),
                       ("fan_in_fan_out", "Conv1D-style (fan_in_fan_out) weights"), ("lora_bias", "LoRA biases"),
                       ("use_qalora", "QA-LoRA")):
        if c.get(flag):
            return f"{flag}=true ({what})"
    if c.get("bias", "none") != "none":
        return f"bias={c['bias']!r} (trained biases)"
    for key in ("rank_pattern", "alpha_pattern"):
        if c.get(key):
            return f"{key} (a rank or alpha per module)"
    for key in ("modules_to_save", "layer_replication", "trainable_token_indices", "target_parameters"):
        if c.get(key):
            return f"{key}={c[key]!r}"
    init = c.get("init_lora_weights")
    if isinstance(init, str) and init.startswith(_BASE_CHANGING_INITS):
        return f"init_lora_weights={init!r} (it changes the base weights; save the adapter converted to plain LoRA)"
    return None


def read_adapter(directory: str | Path) -> PeftAdapter:
    """A PEFT LoRA adapter directory (``adapter_config.json``, ``adapter_model.safetensors``), its tensors renamed
    to the model's (PEFT's ``base_model.model.`` prefix stripped). ValueError in one line for a missing file, an
    option that is not plain LoRA (DoRA, rsLoRA, per-module ranks, trained biases...), a key that is not an
    adapter's, or a module without both factors of rank r."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(directory)
    where = f"LoRA adapter {d}"
    if not d.is_dir():
        raise ValueError(f"{where}: no such directory")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (d / name).is_file():
            raise ValueError(f"{where}: {name} is missing (a PEFT adapter directory holds {ADAPTER_CONFIG} and "
                             f"{ADAPTER_WEIGHTS})")
    try:
        c = json.loads((d / ADAPTER_CONFIG).read_text())
    except ValueError as e:
        raise ValueError(f"{where}: {ADAPTER_CONFIG} is not valid JSON ({e})") from None
    if not isinstance(c, dict):
        raise ValueError(f"{where}: {ADAPTER_CONFIG} is not a JSON object")
    if (why := _unsupported(c)) is not None:
        raise ValueError(f"{where}: unsupported adapter option {why}")
    targets = c.get("target_modules") or ()
    try:
        spec = LoraSpec(rank=int(c["r"]), alpha=float(c["lora_alpha"]), dropout=float(c.get("lora_dropout") or 0.0),
                        target_modules=(targets,) if isinstance(targets, str) else tuple(targets),
                        init="gaussian" if c.get("init_lora_weights") == "gaussian" else "kaiming")
    except KeyError as e:
        raise ValueError(f"{where}: {ADAPTER_CONFIG} has no {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {ADAPTER_CONFIG}: {str(e).splitlines()[0]}") from None
    try:
        raw = load_file(str(d / ADAPTER_WEIGHTS))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS} cannot be read ({e})") from None
    tensors: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        name = key.removeprefix(PEFT_PREFIX)
        if name == key or not name.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA factor ({PEFT_PREFIX}<module>.lora_A.weight "
                             "or .lora_B.weight)")
        tensors[name] = t
    if not tensors:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS} holds no tensors")
    for w, (a, b) in adapter_pairs(tensors).items():
        m = w.removesuffix(".weight")
        if a is None or b is None:
            raise ValueError(f"{where}: {m} has lora_{'A' if a is None else 'B'}.weight missing")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != spec.rank or b.shape[1] != spec.rank:
            raise ValueError(f"{where}: {m} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, not "
                             f"[r, in] and [out, r] with the config's r = {spec.rank}")
    return PeftAdapter(spec, c.get("base_model_name_or_path"), tensors)


def check_adapter(adapter: PeftAdapter, base: Mapping[str, torch.Tensor], where: str = "the base model") -> None:
    """ValueError in one line unless every module ``adapter`` adapts is a weight of ``base`` (tensors, or meta
    tensors, by checkpoint names: ``hub_state``) of shape [out, in] that B·A matches."""
    made_for = f"the adapter was made for {adapter.base_model or 'another model'}"
    for m in adapter.modules:
        w = base.get(f"{m}.weight")
        if w is None or w.ndim != 2:
            raise ValueError(f"LoRA adapter: {where} has no linear weight {m}.weight ({made_for})")
        a, b = adapter.tensors[f"{m}.lora_A.weight"], adapter.tensors[f"{m}.lora_B.weight"]
        if (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ValueError(f"LoRA adapter: {m} is [out, in] = [{b.shape[0]}, {a.shape[1]}] in the adapter but "
                             f"{list(w.shape)} in {where} ({made_for})")


class AdapterMerger:
    """Merge-on-receipt for a replica that serves plain weights: holds a copy of the base (checkpoint names) and
    writes W0 + s·B·A into each adapted served tensor on every update, so the base stays exact however many updates
    arrive. ``served``: the replica's weights under checkpoint names, as views it serves from; ``names``: the ones
    to copy (the adapted weights; every weight where the replica may discard its own, as sleep level 2 does).

    The copies live in host memory (pinned where the replica is on a GPU): on the device they would double the
    adapted weights' bytes, and stay there while the trainer has the GPU, since a sleep frees only the engine's
    own tensors. Each update reads them block by block (``merge_into``)."""

    def __init__(self, served: Mapping[str, torch.Tensor], names: Iterable[str],
                 host: Callable[[int, bool], torch.Tensor] | None = None, dtype: torch.dtype | None = None,
                 pinned: bool | None = None) -> None:
        """``host(nbytes, pinned)``: flat uint8 host memory for the copies (the engine's exact-size pinned buffers;
        default plain host memory); ``dtype``: the copies' dtype (default each source's: a replica's served weights;
        a checkpoint read for a replica that serves another dtype gives that one); ``pinned``: pin the copies
        (default: where the source is on a GPU)."""
        self.base: dict[str, torch.Tensor] = {}
        self._host = host or (lambda nbytes, pinned: torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned))
        self._dtype, self._pinned = dtype, pinned
        self.keep(served, names)

    def keep(self, served: Mapping[str, torch.Tensor], names: Iterable[str]) -> None:
        """Copy ``names`` too (those not kept yet), which ``served`` must hold as the base."""
        for n in names:
            if n not in self.base:
                t = served[n].detach()
                dtype = self._dtype or t.dtype
                pinned = t.device.type == "cuda" if self._pinned is None else self._pinned
                copy = self._host(t.numel() * dtype.itemsize, pinned)
                self.base[n] = copy.view(dtype).view(t.shape)
                self.base[n].copy_(t)

    @torch.no_grad()
    def restore(self, served: Mapping[str, torch.Tensor], skip: Iterable[str] = ()) -> None:
        """Write every kept weight but ``skip`` back into ``served`` (a replica that discarded its weights: the
        unmerged one serves the base itself, the merging one rewrites ``skip``, its adapted weights, next)."""
        missing = sorted(set(served) - set(self.base))
        if missing:
            raise RuntimeError(f"the replica's weights were discarded but no base copy of {missing[0]} is kept "
                               f"({len(missing)} tensors)")
        skip = set(skip)
        for n, t in self.base.items():
            if n not in skip:
                served[n].copy_(t, non_blocking=True)

    @property
    def base_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base.values())

    @torch.no_grad()
    def apply(self, served: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], scaling: float,
              restore: bool = False) -> None:
        """Write every adapted weight from its base and ``adapters`` (all of them, by the model's names);
        ``restore``: first write every other kept weight back (the replica discarded its weights)."""
        if restore:
            self.restore(served, skip=adapter_pairs(adapters))
        for _ in merge_adapters_into(adapters, scaling, self.base, served.__getitem__):
            pass
