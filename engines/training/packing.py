"""Packed variable-length batches for training: sequences laid end to end in rows, with document masking.

A micro-batch of sequences becomes a few rows of concatenated tokens (first-fit decreasing, so a row
wastes only its tail); each token knows its document and its position inside it, so RoPE restarts
per sequence and attention never crosses from one sequence into the next. Tokens past the last
document of a row are filler: they attend to themselves only (the dense path) or to nothing (flex),
and they are never queries of the max-logit statistic nor targets of the loss.

Two ways to run the masked attention, the same pairs either way:
- ``sdpa``: a dense boolean mask [R, 1, W, W] with ``scaled_dot_product_attention``; rows are as wide
  as the longest sequence, so the mask stays small. The CPU path.
- ``flex``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built from the document ids, so
  whole blocks outside every document are skipped; one wide row per micro-batch. The GPU path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engines.device import to_device
from engines.model.native.document_mask import FLEX_BLOCK, DocumentMask

#: The flex path's row is the micro-batch's tokens rounded up to a power of two of at least this many: the
#: compiled kernel then sees a handful of shapes, every one whole mask blocks (a full micro-batch of a
#: power-of-two budget wastes nothing; only each rank's last, partial one carries filler).
FLEX_MIN_ROW = 512


def flex_row_width(tokens: int, width: int | None = None) -> int:
    """The flex path's row width for ``tokens`` tokens (or for rows of ``width``): whole blocks of the block
    mask, a power of two of at least ``FLEX_MIN_ROW`` when the caller sets no width."""
    if width is not None:
        return -(-width // FLEX_BLOCK) * FLEX_BLOCK
    return max(FLEX_MIN_ROW, 1 << (max(tokens, 1) - 1).bit_length())


def first_fit_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``width`` tokens, longest first (first fit)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > width:
            raise ValueError(f"a sequence of {lengths[i]} tokens does not fit a row of {width}")
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


@dataclass(kw_only=True)
class PackedBatch:
    """Prompt+response sequences packed into rows, with what the loss needs to find each response token.

    ``targets`` [R, W] holds, at each position whose next token is a response token, that token's id
    (-1 elsewhere); ``target_seq`` / ``target_index`` name the sequence and the response-token index of
    each target, in the row-major order ``targets >= 0`` selects them; ``target_flat`` is the flat position
    (over R·W) of each target, in that order, so the forward gathers them without a boolean mask (whose
    hidden ``nonzero`` waits for the device). ``tokens`` counts the sequences' tokens (filler excluded).
    """

    ids: torch.Tensor
    mask: DocumentMask
    targets: torch.Tensor
    target_seq: torch.Tensor
    target_index: torch.Tensor
    response_lengths: list[int]
    target_flat: torch.Tensor
    tokens: int

    @property
    def positions(self) -> torch.Tensor:
        return self.mask.positions

    def to(self, device: torch.device | str) -> PackedBatch:
        """This batch on ``device``, copied without blocking the host."""
        m, up = self.mask, lambda t: to_device(t, device)
        return PackedBatch(ids=up(self.ids), mask=DocumentMask(doc=up(m.doc), positions=up(m.positions),
                                                               backend=m.backend),
                           targets=up(self.targets), target_seq=up(self.target_seq),
                           target_index=up(self.target_index), response_lengths=self.response_lengths,
                           target_flat=up(self.target_flat), tokens=self.tokens)

    def per_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """Per-target ``values`` [N] laid out as [sequences, longest response] (0 past each response)."""
        out = values.new_zeros(len(self.response_lengths), max(self.response_lengths, default=0))
        return out.index_put((self.target_seq, self.target_index), values)

    def response_mask(self) -> torch.Tensor:
        """[sequences, longest response] bool: True on each sequence's response tokens."""
        # built on the host from Python ints and uploaded: no blocking copy of a Python list
        width = max(self.response_lengths, default=0)
        lengths = torch.tensor(self.response_lengths, dtype=torch.long)
        return to_device(torch.arange(width)[None] < lengths[:, None], self.ids.device)


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
         backend: str = "sdpa", width: int | None = None) -> PackedBatch:
    """Pack prompt+response pairs into rows with document masking.

    ``sdpa``: rows as wide as the longest sequence (or ``width``). ``flex``: one row of all tokens,
    padded to a power of two of at least ``FLEX_MIN_ROW`` (``width``: rows of that many tokens rounded up
    to whole mask blocks instead).
    """
    # token arrays (a sample's numpy int64) or lists alike, as one tensor per sequence without a Python-list detour
    seqs = [torch.cat([torch.as_tensor(p, dtype=torch.long), torch.as_tensor(r, dtype=torch.long)])
            for p, r in zip(prompts, responses, strict=True)]
    lengths = [len(s) for s in seqs]
    if not seqs or any(len(p) == 0 for p in prompts):
        raise ValueError("every sequence needs a prompt of at least one token")
    if backend == "flex":
        width = flex_row_width(sum(lengths), width)
    elif width is None:
        width = max(lengths)
    rows = first_fit_rows(lengths, width)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    doc = torch.full((len(rows), width), -1, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.full((len(rows), width), -1, dtype=torch.long)
    # the row-major order of targets decides the order of the flat outputs; record it per position
    seq_at = torch.full((len(rows), width), -1, dtype=torch.long)
    index_at = torch.zeros((len(rows), width), dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            n, p = lengths[i], len(prompts[i])
            ids[r, start:start + n] = seqs[i]
            doc[r, start:start + n] = i
            pos[r, start:start + n] = torch.arange(n)
            # the logits at position p-1+j predict response token j
            targets[r, start + p - 1:start + n - 1] = seqs[i][p:]
            seq_at[r, start + p - 1:start + n - 1] = i
            index_at[r, start + p - 1:start + n - 1] = torch.arange(n - p)
            start += n
    chosen = targets >= 0  # on the host: its nonzero waits for nothing
    return PackedBatch(ids=ids, mask=DocumentMask(doc=doc, positions=pos, backend=backend), targets=targets,
                       target_seq=seq_at[chosen], target_index=index_at[chosen],
                       response_lengths=[len(r) for r in responses],
                       target_flat=chosen.flatten().nonzero().squeeze(-1), tokens=sum(lengths))
