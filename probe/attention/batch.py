"""Several sequences in one pass: right padding, which a causal model cannot see.

A probe given several sequences (:func:`is_batch`) pads them on the right into one
LongTensor[batch, seq] and runs one pass. Under causal attention no real token attends to a later
position, so every real token's hidden states, attention rows, loss and gradients are those of its
sequence run alone (sliding windows included: positions are unchanged), and no attention mask is
needed. A ``[batch, seq]`` tensor padded on the left or the right comes with its ``attention_mask``
(1 = token, 0 = padding); its real tokens are taken out and padded on the right again. Results are
per sequence, over its real tokens (``target_positions`` and ``rows`` index the rows as given).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from probe.checks import check_input_ids, check_integers, check_positions, hf_model, input_device
from probe.errors import InvalidTypeError, InvalidValueError
from probe.target import Target, target_loss_of


def is_batch(input_ids, attention_mask: torch.Tensor | None = None) -> bool:
    """Several sequences: a list of sequences, a ``[batch > 1, seq]`` tensor, or any ``attention_mask``."""
    if attention_mask is not None:
        return True
    if isinstance(input_ids, torch.Tensor):
        return input_ids.ndim == 2 and input_ids.shape[0] > 1
    if not isinstance(input_ids, (list, tuple)):
        raise InvalidTypeError(f"input_ids must be a tensor or a list of token ids, got {input_ids!r:.60}")
    return (
        len(input_ids) > 0 and not isinstance(input_ids[0], int) and torch.as_tensor(input_ids[0]).ndim == 1
    )


@dataclass(frozen=True)
class Batch:
    """Right-padded sequences and each one's query positions.

    ``input_ids``: LongTensor[batch, seq] (padded with each row's last token); ``lengths``: real tokens
    of each sequence; ``positions``: LongTensor[k_b] per sequence (target positions or rows), in the
    sequence's own coordinates; ``union``: the sorted union of all ``positions`` (LongTensor[u]), which
    a batched pass computes for every sequence; ``offsets``: where each sequence started in its input
    row (left padding), to map positions back.
    """

    input_ids: torch.Tensor
    lengths: list[int]
    positions: list[torch.Tensor]
    union: torch.Tensor
    offsets: list[int]

    def __len__(self) -> int:
        return len(self.lengths)

    def index(self, b: int) -> torch.Tensor:
        """Where sequence ``b``'s positions sit in :attr:`union`: LongTensor[k_b]."""
        return torch.searchsorted(self.union, self.positions[b].to(self.union.device))


def batch_of(
    model,
    input_ids,
    positions: Sequence,
    attention_mask: torch.Tensor | None = None,
    what: str = "target_positions",
    minimum: int = 0,
) -> Batch:
    """Check and right-pad several sequences (see the module docstring) with one list of positions each.

    ``input_ids``: a list of LongTensor[seq_b] (or lists of ids), or LongTensor[batch, seq] with
    ``attention_mask`` [batch, seq] (padding on either side; each row's tokens contiguous).
    ``positions``: one sequence of positions per input row, indexing that row as given.
    """
    sequences, offsets = _sequences(input_ids, attention_mask)
    flat = torch.is_tensor(positions) and positions.ndim < 2 or isinstance(positions, (int, str))
    if flat or not torch.is_tensor(positions) and any(isinstance(p, (int, np.integer)) for p in positions):
        raise InvalidTypeError(
            f"{what} for {len(sequences)} sequences must be one list of positions per sequence "
            f"([[...], [...]]), got one flat list {positions!r}"
        )
    if len(positions) != len(sequences):
        raise InvalidValueError(
            f"{len(sequences)} sequences but {len(positions)} lists of {what}: give one list each"
        )
    checked, shifted = [], []
    for b, (ids, where, offset) in enumerate(zip(sequences, positions, offsets, strict=True)):
        ids = check_input_ids(model, ids)[0]
        label = what if len(sequences) == 1 else f"{what} of sequence {b}"
        where = check_integers(where, label).reshape(-1) - offset
        label += f" (less its {offset} padding tokens)" if offset else ""
        checked.append(ids)
        shifted.append(check_positions(where, len(ids), label, minimum))
    lengths = [len(ids) for ids in checked]
    padded = torch.stack([torch.cat([ids, ids[-1:].expand(max(lengths) - len(ids))]) for ids in checked])
    union = torch.cat(shifted).unique(sorted=True)
    device = input_device(model)
    return Batch(padded.to(device), lengths, [p.to(device) for p in shifted], union.to(device), offsets)


def _sequences(input_ids, attention_mask: torch.Tensor | None) -> tuple[list[torch.Tensor], list[int]]:
    """The real tokens of each row and where they start in it."""
    if attention_mask is None:
        if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2:
            return list(input_ids), [0] * len(input_ids)
        sequences = [torch.as_tensor(ids, dtype=torch.long).reshape(-1) for ids in input_ids]
        if not sequences:
            raise InvalidValueError("no sequences given")
        return sequences, [0] * len(sequences)
    ids, mask = torch.as_tensor(input_ids), torch.as_tensor(attention_mask).bool()
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise InvalidValueError(
            f"attention_mask {tuple(mask.shape)} must have the shape of input_ids [batch, seq], "
            f"{tuple(ids.shape)}"
        )
    sequences, offsets = [], []
    for row, keep in zip(ids, mask, strict=True):
        where = keep.nonzero().reshape(-1)
        if where.numel() == 0 or where[-1] - where[0] + 1 != where.numel():
            raise InvalidValueError(
                "each row of attention_mask needs one contiguous run of tokens (left or right padding)"
            )
        sequences.append(row[where[0] : where[-1] + 1])
        offsets.append(int(where[0]))
    return sequences, offsets


def batch_loss(model, batch: Batch, target: Target | None = None, **forward_kwargs) -> torch.Tensor:
    """Σ_b (−target / k_b of sequence b's k_b target tokens), each predicted from row t − 1.

    The sum of the per-sequence losses of :func:`probe.target.target_loss`, so the gradient with
    respect to anything of sequence b is that of its own loss. Only the union of the rows t − 1 is
    projected to the vocabulary. ``forward_kwargs`` may pass ``inputs_embeds`` instead of ids.
    """
    inner = hf_model(model)
    if "inputs_embeds" not in forward_kwargs:
        forward_kwargs["input_ids"] = batch.input_ids
    logits = inner(use_cache=False, logits_to_keep=batch.union - 1, **forward_kwargs).logits
    losses = [
        target_loss_of(target, logits[b, batch.index(b)], batch.input_ids[b, batch.positions[b]])
        for b in range(len(batch))
    ]
    return torch.stack(losses).sum()
