"""Where each tensor of a transformers model's checkpoint lives in the model's own tensors.

transformers 5 keeps some weights in another layout than its checkpoints: MoE experts stacked into one 3-D tensor
(``mlp.experts.gate_up_proj`` [E, 2I, H]) where the checkpoint has one matrix per expert and projection
(``mlp.experts.3.gate_proj.weight``), or a prefix renamed (Nemotron-H's ``model.`` is ``backbone.`` on disk). Its
loader converts a checkpoint into the model's layout, and ``save_pretrained`` converts back
(``transformers.core_model_loading.revert_weight_conversion``). The checkpoint engine, the start-up read and the
trainer's saves need the same map as placements (``engines.model.layout.Placement``: a checkpoint tensor is a
contiguous run of elements of one model tensor), so it is read from transformers' own reverse conversion, run on
probes instead of weights: once on the meta device for the checkpoint's names and shapes, once on one int64 per
row (every dimension but the last) carrying its tensor and row index. Row probes cost a fraction of the weights
(one number per row) and cross the same chunk/stack/rename operations; a checkpoint tensor whose rows are not
consecutive rows of one model tensor (a transposed or interleaved conversion) is refused in one line.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.model.layout import Placement, model_tensors
from engines.model.native.arch import UnsupportedModelError

#: a row probe's value: tensor index · TAG + row index (exact in int64 for 2^23 tensors of 2^40 rows)
TAG = 1 << 40


def _row_probe(index: int, t: torch.Tensor) -> torch.Tensor:
    """One int64 per row of ``t`` (its last dimension kept as 1): ``index`` · TAG + the row's number."""
    lead = tuple(t.shape[:-1]) if t.ndim else ()
    rows = 1
    for s in lead:
        rows *= s
    probe = torch.arange(rows, dtype=torch.int64) + index * TAG
    return probe.reshape(*lead, 1) if t.ndim else probe.reshape(())


def checkpoint_placements(hf_model: nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, Placement]:
    """Checkpoint tensor name -> its placement in ``hf_model``'s tensors (``tensors``: the model's own by name,
    default ``engines.model.layout.model_tensors(hf_model)``; a tied output head is its embedding), as
    transformers' ``save_pretrained`` would write them."""
    from transformers.core_model_loading import revert_weight_conversion

    own = tensors if tensors is not None else model_tensors(hf_model)
    names = list(own)
    with torch.no_grad():
        shapes = revert_weight_conversion(hf_model, {n: torch.empty(t.shape, dtype=t.dtype, device="meta")
                                                     for n, t in own.items()})
        rows = revert_weight_conversion(hf_model, {n: _row_probe(i, t) for i, (n, t) in enumerate(own.items())})
    out: dict[str, Placement] = {}
    for name, meta in shapes.items():
        probe = rows[name].reshape(-1)
        index = int(probe[0]) // TAG
        target = own[names[index]]
        first = int(probe[0]) - index * TAG
        row = target.shape[-1] if target.ndim else 1
        if not bool((probe == probe[0] + torch.arange(probe.numel())).all()) or probe.numel() * row != meta.numel():
            raise UnsupportedModelError(f"{type(hf_model).__name__}: checkpoint tensor {name} is not a contiguous "
                                        f"piece of one model tensor (transformers converts it with a transpose or "
                                        "an interleave), which the weight transfer cannot place")
        out[name] = Placement(names[index], first * row, tuple(meta.shape))
    return out
