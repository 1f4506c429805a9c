"""The transformers backend: any causal LM that transformers implements, under the native model's forward contract.

``HFCausalLM`` wraps transformers' own modeling code (``AutoModelForCausalLM``) so that the training engine runs it
as it runs ``engines.model.native.causal_lm.CausalLM``: ``model(ids, positions, DocumentMask, select=, targets=,
inv_temp=)`` returns each target's (log-prob, entropy) from the chunked vocabulary scoring
(``engines.model.logprobs``), never the full logits; ``model.config`` describes the model
(``engines.model.hf.spec.ModelDescription``); ``model.activation_checkpointing`` recomputes each decoder layer
in the backward; the decoder layers FSDP2 shards are ``decoder_layers(model)``; the attention modules keep
``max_logits`` per head for QK-Clip (``attention_modules()``, each with ``clip_heads`` from
``engines.model.hf.qk_clip_plan``). Parameter names are transformers' own (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``), so the state dict is the checkpoint's.

Packed rows: every softmax-attention layer attends through ``engines.model.hf.attention.document_attention`` over
the batch's ``DocumentMask`` (sliding windows, sinks and soft-capping as the layer passes them). Families whose
layers carry state along the sequence (linear attention, state-space, short convolutions: Qwen3-Next / Qwen3.5,
Nemotron-H, LFM2) cannot stop that state at a document's end, so their packed rows are unpacked: each document
runs in a row of its own (right-padded, which leaves its tokens exact: every mixer is causal) and the hidden
states are put back where the packing had them.

The wrapped model always runs with its modules in eval mode, whatever ``train()`` says: dropout and router noise
stay off, so the trainer scores tokens exactly as the rollout engine sampled them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from engines.model.hf.attention import IMPLEMENTATION, PACKED_KWARG, PackedAttention, recomputing, register
from engines.model.hf.qk_clip_plan import QKClipRule, qk_clip_plan
from engines.model.hf.spec import auto_class, check_supported, decoder_layers, describe, is_vision_language
from engines.model.hf.vision import PackedMedia, mrope_positions, placeholders_where_images_are
from engines.model.logprobs import selected_logprobs
from engines.model.native.arch import UnsupportedModelError
from engines.model.native.document_mask import DocumentMask

__all__ = ["HFCausalLM", "build_hf_model", "check_loadable", "decoder_layers", "empty_hf_model", "load_hf_model",
           "materialize", "read_hf_config"]


def _without_dropout(hf_config):
    """A copy of ``hf_config`` with every dropout probability and router noise at 0 (RL scores deterministically)."""
    cfg = copy.deepcopy(hf_config)
    for c in {id(cfg): cfg, id(t := cfg.get_text_config()): t}.values() if hasattr(cfg, "get_text_config") else [cfg]:
        for key, value in c.to_dict().items():
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key or key == "router_jitter_noise"):
                setattr(c, key, 0.0)
    return cfg


def attention_choice(hf_config) -> str | dict[str, str]:
    """The ``attn_implementation`` to build ``hf_config``'s model with: the document-masked attention for the
    language model; a vision tower keeps SDPA (its patches attend within their image, not over the packed rows)."""
    if not is_vision_language(hf_config):
        return IMPLEMENTATION
    return {"": IMPLEMENTATION, "text_config": IMPLEMENTATION, "vision_config": "sdpa"}


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the native forward contract (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, source_config=None) -> None:
        """``source_config``: the config the model was made from, as saves write it (default: the model's own,
        whose dropout probabilities are 0 when ``build_hf_model``/``load_hf_model`` made it)."""
        super().__init__()
        register()
        self.vision = is_vision_language(hf_model.config)
        if hf_model.config.get_text_config()._attn_implementation != IMPLEMENTATION:
            hf_model.set_attn_implementation(attention_choice(hf_model.config))
        if any(True for _ in hf_model.named_parameters(recurse=False)):
            raise UnsupportedModelError(f"{type(hf_model).__name__} holds parameters outside its sub-modules")
        self.hf_config = hf_model.config
        self.source_config = source_config if source_config is not None else hf_model.config
        self.config = describe(hf_model.config, hf_model)
        # the causal LM's children become ours (the names stay transformers'); the causal LM itself is kept
        # outside the module tree: its forward (full logits) is never run
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "hf_model", hf_model)
        # a vision-language model runs whole below its head (vision tower, merging, language model): its base
        self._base = hf_model.base_model_prefix if self.vision or not hasattr(hf_model, "get_decoder") else \
            next(n for n, c in hf_model.named_children() if c is hf_model.get_decoder())
        head = hf_model.get_output_embeddings()
        self._head = next(n for n, c in hf_model.named_children() if c is head)
        self._no_split_modules = hf_model._no_split_modules
        self.layers = decoder_layers(self)
        self.qk_clip_rules: list[QKClipRule] = qk_clip_plan(self.layers, self.hf_config)
        for rule in self.qk_clip_rules:
            if rule.module is not None:
                rule.module.track_logits, rule.module.max_logits = False, None
                if not hasattr(rule.module, "num_heads"):
                    rule.module.num_heads = rule.num_heads
                rule.module.clip_heads = rule.clip
                rule.module.qk_clip_reason = rule.reason  # what QK-Clip's one-time warning says of the layer
        self._checkpointing = False
        self._placements: dict | None = None
        self.train()

    def checkpoint_placements(self) -> dict:
        """Checkpoint tensor name -> ``engines.model.layout.Placement`` in this model's tensors, as transformers'
        ``save_pretrained`` names and lays them out (``engines.model.hf.layout``); computed once."""
        if self._placements is None:
            from engines.model.hf.layout import checkpoint_placements
            from engines.model.layout import is_adapter, model_tensors, placed_tensors

            # LoRA's adapters (engines.model.lora.adapters) are no checkpoint tensor: they travel and are saved on
            # their own
            own = {n: t for n, t in placed_tensors(self, model_tensors(self)).items() if not is_adapter(n)}
            self._placements = checkpoint_placements(self.hf_model, own)
        return self._placements

    # ---- the module tree ------------------------------------------------------------------------

    def train(self, mode: bool = True) -> HFCausalLM:
        """``training`` is recorded, the wrapped modules stay in eval mode (no dropout, no router noise);
        a decoder layer is "training" only to let transformers' checkpointing wrapper run."""
        super().train(mode)
        for name, m in self.named_modules():
            # LoRA's own dropout (model.lora.dropout, engines.model.lora.adapters) follows the mode: it is the run's
            # choice
            m.training = mode and name.endswith(".lora_dropout")
        self.training = mode
        for layer in self.layers:
            layer.training = mode and self._checkpointing
        return self

    @property
    def activation_checkpointing(self) -> bool:
        """Keep only each decoder layer's input in training forwards, recomputing the rest in the backward."""
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        if on and not all(isinstance(layer, GradientCheckpointingLayer) for layer in self.layers):
            raise UnsupportedModelError(f"{type(self.layers[0]).__name__} does not support activation checkpointing")
        self._checkpointing = bool(on)
        for layer in self.layers:
            layer.gradient_checkpointing = self._checkpointing
            layer._gradient_checkpointing_func = _checkpoint
        self.train(self.training)

    def attention_modules(self) -> list[nn.Module]:
        """The softmax attention modules, in layer order (each has ``max_logits``, ``num_heads``, ``clip_heads``)."""
        return [r.module for r in self.qk_clip_rules if r.module is not None]

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: DocumentMask | None = None,
                cache=None, select: torch.Tensor | None = None, *, targets: torch.Tensor | None = None,
                inv_temp: torch.Tensor | float = 1.0,
                media: PackedMedia | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``CausalLM.forward`` without a cache: logits [B, T, V] (or [M, V] at ``select``) for tokens [B, T]
        at positions [B, T] under ``mask`` (None: each row one document), or with ``targets`` the (log-prob,
        entropy) [N] of each target under softmax(logits · ``inv_temp``), scored in vocabulary chunks.
        ``media``: the rows' images (``engines.model.hf.vision.pack_media``), for a vision-language model."""
        if cache is not None:
            raise ValueError("the transformers backend trains and scores; it has no decoding cache")
        if mask is None:
            mask = DocumentMask.from_padded(torch.ones_like(input_ids, dtype=torch.bool))
        elif not isinstance(mask, DocumentMask):
            raise TypeError(f"the transformers backend takes a DocumentMask, not {type(mask).__name__}")
        if media is not None and not self.vision:
            raise ValueError(f"{self.config.model_type} is a text-only model: it takes no images")
        hidden = self.hidden_states(input_ids, positions, mask, media)
        weight = getattr(self, self._head).weight
        cap, scale = self.config.final_logit_softcapping, self.config.logit_scale
        if targets is not None:
            if select is None:
                select = (targets >= 0).flatten().nonzero().squeeze(1)
            h, chosen = hidden.flatten(0, 1)[select], targets.flatten()[select]
            return selected_logprobs(h, weight, chosen, inv_temp * scale if scale != 1.0 else inv_temp, softcap=cap)
        if select is not None:
            hidden = hidden.flatten(0, 1)[select]
        logits = getattr(self, self._head)(hidden) * scale
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: DocumentMask,
                      media: PackedMedia | None = None) -> torch.Tensor:
        """The base model's last hidden states [B, T, D] (after its final norm) for packed rows."""
        if self.config.packable or not bool((mask.doc >= 0).any()):
            return self._run(input_ids, positions, mask, media)
        if media is not None:
            raise ValueError(f"{self.config.model_type}: images in rows that must be unpacked are not supported")
        return self._unpacked(input_ids, mask)

    def _run(self, input_ids, positions, mask: DocumentMask, media: PackedMedia | None = None) -> torch.Tensor:
        base = getattr(self, self._base)
        extra = {}
        if self.vision:
            rope = mrope_positions(base, input_ids, mask, media)
            positions = positions if rope is None else rope
            extra = dict(media.tensors) if media is not None else {}
        with placeholders_where_images_are(base, input_ids, media):
            out = base(input_ids=input_ids, position_ids=positions, use_cache=False,
                       **{PACKED_KWARG: PackedAttention(mask)}, **extra)
        return out.last_hidden_state

    def _unpacked(self, input_ids, mask: DocumentMask) -> torch.Tensor:
        """One row per document (right-padded), the hidden states put back at the packed positions; filler
        positions get zeros (they are never scored)."""
        valid = mask.doc >= 0
        _, row_of = torch.unique(mask.doc[valid], return_inverse=True)
        pos = mask.positions[valid]
        n, width = int(row_of.max()) + 1, int(pos.max()) + 1
        ids = input_ids.new_zeros((n, width))
        ids[row_of, pos] = input_ids[valid]
        present = torch.zeros((n, width), dtype=torch.bool, device=input_ids.device)
        present[row_of, pos] = True
        positions = torch.arange(width, device=input_ids.device).expand(n, width)
        hidden = self._run(ids, positions, DocumentMask.from_padded(present, mask.backend))
        out = hidden.new_zeros((*input_ids.shape, hidden.shape[-1]))
        return out.index_put((valid.nonzero(as_tuple=True)), hidden[row_of, pos])


def _checkpoint(run_layer, *args):
    """transformers' checkpointing hook for one decoder layer: non-reentrant, and the recompute in the backward
    does not fold its (identical) attention logits into the tracked maxima again."""
    calls = [0]

    def run(*a):
        calls[0] += 1
        token = recomputing.set(calls[0] > 1)
        try:
            return run_layer(*a)
        finally:
            recomputing.reset(token)

    return checkpoint(run, *args, use_reentrant=False)


def build_hf_model(hf_config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   trust_remote_code: bool = False) -> HFCausalLM:
    """A randomly initialised (transformers' own init) model of ``hf_config`` on ``device`` in ``dtype``."""
    check_supported(hf_config)
    register()
    with torch.device(device):
        hf = auto_class(hf_config).from_config(_without_dropout(hf_config),
                                               attn_implementation=attention_choice(hf_config), dtype=dtype,
                                               trust_remote_code=trust_remote_code)
    return HFCausalLM(hf, hf_config)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside put their parameters on the meta device and keep their buffers where torch makes
    them: a rotary table or an embedding scale is computed from the config at build time (transformers registers
    them as non-persistent buffers, which no checkpoint holds), the weights come later."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_hf_model(hf_config, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> HFCausalLM:
    """The model of ``hf_config`` with its parameters on the meta device (no memory, any size) and its buffers
    computed on the host: ``materialize`` (or ``engines.training.distributed.shard_model``) gives the parameters
    storage for a checkpoint read to fill."""
    check_supported(hf_config)
    register()
    with _parameters_on_meta():
        hf = auto_class(hf_config).from_config(_without_dropout(hf_config),
                                               attn_implementation=attention_choice(hf_config), dtype=dtype,
                                               trust_remote_code=trust_remote_code)
    return HFCausalLM(hf, hf_config)


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Give a model built by ``empty_hf_model`` uninitialised parameters on ``device``; its buffers keep their
    values (``to_empty`` alone would leave them uninitialised too) and a tied output head stays tied."""
    kept = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    model.to_empty(device=device)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in kept:
                b.copy_(kept[n])
    hf = model.hf_model if isinstance(model, HFCausalLM) else model
    if getattr(hf.config.get_text_config(), "tie_word_embeddings", False):
        hf.get_output_embeddings().weight = hf.get_input_embeddings().weight
    return model


def read_hf_config(path: str | Path, trust_remote_code: bool = False):
    """transformers' config of the model directory ``path``, checked: one line (UnsupportedModelError) for a model
    type transformers does not know, remote code without ``trust_remote_code``, or what the backend cannot run."""
    from transformers import AutoConfig

    check_loadable(path, trust_remote_code)
    try:
        cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise UnsupportedModelError(f"{path}: transformers cannot read its config.json ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''})") from None
    check_supported(cfg)
    return cfg


def check_loadable(path: str | Path, trust_remote_code: bool = False) -> None:
    """Raise UnsupportedModelError (one line) when the directory's ``config.json`` names a model type transformers
    does not know: one that needs the checkpoint's own code without ``trust_remote_code``, or an unknown one."""
    import json

    from transformers import CONFIG_MAPPING

    file = Path(path) / "config.json"
    if not file.is_file():
        return  # a hub id: transformers resolves it and says what is missing
    d = json.loads(file.read_text())
    model_type = d.get("model_type")
    if model_type in CONFIG_MAPPING:
        return
    if d.get("auto_map"):
        if not trust_remote_code:
            raise UnsupportedModelError(f"model_type {model_type!r} needs the checkpoint's own code (auto_map): "
                                        "set model.trust_remote_code: true to run it")
        return
    raise UnsupportedModelError(f"model_type {model_type!r} is not known to transformers "
                                f"{__import__('transformers').__version__} and the checkpoint brings no code")


def load_hf_model(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  trust_remote_code: bool = False) -> HFCausalLM:
    """The model saved in the Hugging Face directory ``path``, on ``device`` in ``dtype``; a model that needs
    remote code is refused (one line) unless ``trust_remote_code``."""
    from transformers import AutoConfig

    check_loadable(path, trust_remote_code)
    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    check_supported(cfg)
    register()
    hf = auto_class(cfg).from_pretrained(path, config=_without_dropout(cfg), attn_implementation=attention_choice(cfg),
                                         dtype=dtype, device_map=None, trust_remote_code=trust_remote_code)
    return HFCausalLM(hf.to(device), cfg)

