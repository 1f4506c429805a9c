"""The images of a packed batch, for a vision-language model under the transformers backend.

A packed row holds several documents end to end (``engines.training.packing``). A vision-language model's forward
takes its images' tensors concatenated in the order their tokens appear in the flattened rows (its vision tower
encodes every image, and the features are scattered onto the image tokens in that order), so ``pack_media`` orders
the documents' tensors by (row, start). Families with multimodal RoPE (Qwen2/2.5/3-VL, GLM-4V: a (t, h, w)
position per token, text after an image continuing from the image's largest position) get their positions per
document from the model's own ``get_rope_index`` on that document alone (``mrope_positions``), so each document
starts at 0 as it did when it was sampled.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from engines.model.native.document_mask import DocumentMask

__all__ = ["DocumentMedia", "PackedMedia", "mrope_positions", "pack_media", "placeholders_where_images_are"]


@dataclass
class DocumentMedia:
    """One document's images as its processor made them (``engines.model.text.processor.Expanded``): ``tensors``
    (pixel values, grids, ...) and ``mm_token_type_ids`` (1 on its image tokens), and where the packing put it."""

    tensors: Mapping[str, torch.Tensor]
    mm_token_type_ids: Sequence[int]
    row: int = -1
    start: int = -1
    length: int = 0


@dataclass
class PackedMedia:
    """The images of a packed batch: ``tensors`` as the model's forward takes them (concatenated in token order)
    and ``documents`` (those with images, in that order)."""

    tensors: dict[str, torch.Tensor]
    documents: list[DocumentMedia] = field(default_factory=list)

    def to(self, device: torch.device | str) -> PackedMedia:
        return PackedMedia({k: v.to(device, non_blocking=True) for k, v in self.tensors.items()}, self.documents)


def _document_spans(mask: DocumentMask) -> list[tuple[int, int, int, int]]:
    """(document index, row, start, length) of every document of the rows, in flattened row-major order."""
    doc = mask.doc.detach().cpu()
    out = []
    for r in range(doc.shape[0]):
        values, counts = torch.unique_consecutive(doc[r], return_counts=True)
        start = 0
        for v, c in zip(values.tolist(), counts.tolist(), strict=True):
            if v >= 0:
                out.append((v, r, start, c))
            start += c
    return out


def _concatenate(key: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """One key's tensors of several documents as one forward takes them. A processor that returns a batch
    dimension per prompt (pixel values [1, images, C, H, W]: Idefics3, SmolVLM) has its documents' images laid
    side by side in one prompt's worth (the model flattens prompts × images); flat ones ([patches, dim],
    [images, 3]) are stacked."""
    if parts[0].dim() >= 4 and all(p.shape[0] == 1 for p in parts) and key.startswith("pixel"):
        return torch.cat([p.flatten(0, 1) for p in parts]).unsqueeze(0)
    return torch.cat(parts)


def pack_media(mask: DocumentMask, media: Sequence[DocumentMedia | None]) -> PackedMedia | None:
    """The images of ``media`` (one entry per packed sequence, None without images) for the rows of ``mask``;
    None when no sequence has any."""
    spans = [(media[d], r, s, n) for d, r, s, n in _document_spans(mask) if d < len(media) and media[d] is not None
             and media[d].tensors]
    if not spans:
        return None
    docs = [DocumentMedia(m.tensors, m.mm_token_type_ids, row=r, start=s, length=n) for m, r, s, n in spans]
    keys = list(docs[0].tensors)
    if any(list(d.tensors) != keys for d in docs):
        raise ValueError("the documents of one batch carry different image inputs: "
                         f"{sorted({tuple(d.tensors) for d in docs})}")
    return PackedMedia({k: _concatenate(k, [d.tensors[k] for d in docs]) for k in keys}, docs)


def mrope_positions(base: nn.Module, input_ids: torch.Tensor, mask: DocumentMask,
                    media: PackedMedia | None) -> torch.Tensor | None:
    """Multimodal RoPE positions [3, R, W] for packed rows when ``base`` has them (``get_rope_index``), else None:
    text-only documents get their 1-D positions on all three axes, documents with images the model's own
    ``get_rope_index`` of the document alone."""
    rope_index = getattr(base, "get_rope_index", None)
    if rope_index is None:
        return None
    positions = mask.positions.unsqueeze(0).expand(3, *mask.positions.shape).clone()
    for d in media.documents if media is not None else ():
        ids = input_ids[d.row, d.start:d.start + d.length].unsqueeze(0)
        # the prompt's types; what follows it (the response, text) is 0
        types = torch.zeros((1, d.length), dtype=torch.int32, device=ids.device)
        if len(d.mm_token_type_ids) > d.length:
            raise ValueError(f"a document of {d.length} tokens has {len(d.mm_token_type_ids)} multimodal token types")
        types[0, :len(d.mm_token_type_ids)] = torch.as_tensor(list(d.mm_token_type_ids), dtype=torch.int32)
        kw = {k: v.to(ids.device) for k, v in d.tensors.items() if k.endswith("grid_thw")}
        pos, _ = rope_index(ids, mm_token_type_ids=types, **kw)
        positions[:, d.row, d.start:d.start + d.length] = pos[:, 0].to(positions.dtype)
    return positions


@contextmanager
def placeholders_where_images_are(base: nn.Module, input_ids: torch.Tensor,
                                  media: PackedMedia | None) -> Iterator[None]:
    """Inside: ``base`` takes image (and video) placeholder tokens only where the processor put them. A response may
    hold a placeholder token the model sampled (a tiny or early policy does); the rollout engine read it as the
    text token it is, and transformers' own ``get_placeholder_mask`` would count it as an image's (and refuse the
    batch: more tokens than features). Elsewhere such a token is hidden from the mask, not from the model."""
    original = getattr(base, "get_placeholder_mask", None)
    cfg = getattr(base, "config", None)
    marks = [getattr(cfg, k, None) for k in ("image_token_id", "video_token_id", "image_token_index")]
    marks = [m for m in marks if isinstance(m, int)]
    if original is None or media is None or not marks:
        yield
        return
    images = torch.zeros_like(input_ids, dtype=torch.bool)
    for d in media.documents:
        types = torch.as_tensor(list(d.mm_token_type_ids), dtype=torch.bool, device=input_ids.device)
        images[d.row, d.start:d.start + len(types)] = types
    stray = torch.isin(input_ids, torch.tensor(marks, device=input_ids.device)) & ~images

    def only_images(ids, *args, **kwargs):
        return original(ids.masked_fill(stray, -1) if ids is not None and ids.shape == stray.shape else ids,
                        *args, **kwargs)

    base.get_placeholder_mask = only_images
    try:
        yield
    finally:
        del base.get_placeholder_mask  # the class's method again
