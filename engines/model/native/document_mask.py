"""Which tokens of packed rows may attend to which: one document per sequence, causal, optionally windowed.

Training packs sequences end to end in rows (``engines.training.packing``); each token knows its
document and its position inside it. The attention layers take this mask in two forms: a dense
boolean mask for ``scaled_dot_product_attention`` (the CPU path) and a flex_attention ``BlockMask``
(the GPU path), the same pairs either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: flex_attention's block size: whole blocks outside every document are skipped.
FLEX_BLOCK = 128


@dataclass(kw_only=True)
class DocumentMask:
    """Which (query, key) pairs of packed rows may attend: same document, key not after the query and,
    with ``window``, less than ``window`` positions behind it. ``doc`` is -1 on filler tokens."""

    doc: torch.Tensor        # [R, W] long
    positions: torch.Tensor  # [R, W] long, position inside its document
    backend: str = "sdpa"
    window: int | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def query_valid(self) -> torch.Tensor:
        """[R, W] bool: the tokens that belong to a document (filler excluded)."""
        return self.doc >= 0

    def clear_cache(self) -> None:
        """Forget the masks built so far (a caller that keeps the packing but not its masks between passes)."""
        self._cache.clear()

    def with_window(self, window: int | None) -> DocumentMask:
        """The same packing limited to a sliding window (shares the cached masks of this packing)."""
        if window == self.window:
            return self
        return DocumentMask(doc=self.doc, positions=self.positions, backend=self.backend, window=window,
                            _cache=self._cache)

    def dense(self) -> torch.Tensor:
        """Boolean [R, 1, W, W] (True = may attend); filler rows keep their own diagonal so softmax
        never sees an empty row."""
        key = ("dense", self.window)
        if key not in self._cache:
            w = self.doc.shape[1]
            idx = torch.arange(w, device=self.doc.device)
            allowed = (self.doc[:, :, None] == self.doc[:, None, :]) & (idx[None, :, None] >= idx[None, None, :])
            allowed &= self.query_valid[:, :, None]
            if self.window is not None:
                allowed &= (idx[:, None] - idx[None, :] < self.window)[None]
            allowed |= torch.eye(w, dtype=torch.bool, device=self.doc.device)[None]
            self._cache[key] = allowed[:, None]
        return self._cache[key]

    def block_mask(self):
        """The flex_attention ``BlockMask`` of these pairs (filler attends to nothing)."""
        key = ("block", self.window)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            doc, window = self.doc, self.window

            def mask_mod(b, h, q, k):
                same = (doc[b, q] == doc[b, k]) & (doc[b, q] >= 0) & (q >= k)
                return same if window is None else same & (q - k < window)

            r, w = doc.shape
            # compiled on GPU so the [R, W, W] mask is never materialised; eager elsewhere (tests on CPU)
            self._cache[key] = create_block_mask(mask_mod, r, None, w, w, device=doc.device, BLOCK_SIZE=FLEX_BLOCK,
                                                 _compile=doc.device.type == "cuda")
        return self._cache[key]

    @classmethod
    def from_padded(cls, valid: torch.Tensor, backend: str = "sdpa") -> DocumentMask:
        """One document per row of a right-padded batch (``valid`` [B, T]); padding is filler."""
        doc = torch.where(valid, torch.arange(valid.shape[0], device=valid.device)[:, None], -1)
        return cls(doc=doc, positions=(valid.long().cumsum(-1) - 1).clamp(min=0), backend=backend)
