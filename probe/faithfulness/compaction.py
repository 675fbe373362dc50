"""Running a model without some of its tokens, exactly: the passes of every ablation.

Two ways give the same numbers: **key masking** (the removed tokens stay in the sequence and no query
sees them, :func:`probe.mask_keys`) and **compaction** (only the kept tokens run, at their original
positions, every mask measured in original positions: :func:`compacted`), cheaper by the share
removed, for models that take ``position_ids`` (:func:`compaction_supported`). Both start from a
reused KV cache of the unmasked prefix; :func:`probe.faithfulness.answer_scores` runs them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch

from probe.attention.modifiers import mask_keys, original_positions
from probe.checks import cache_keyword, hf_model
from probe.errors import InvalidValueError
from probe.tasks import Source


def check_before_answer(hidden: torch.Tensor, first_row: int) -> None:
    """Refuse removals that reach the answer: ``hidden`` (BoolTensor[masks, seq], True = removed) must
    keep every token from ``first_row``, the row that predicts the first answer token, on."""
    reached = hidden[:, first_row:].any(0).nonzero()[:, 0] + first_row
    if reached.numel():
        raise InvalidValueError(
            f"positions {reached.tolist()[:8]} are removed but lie at or after the first answer row "
            f"({first_row}): remove only tokens before the answer (sources must lie before it)"
        )


@contextmanager
def compacted(model, positions: torch.Tensor, past_length: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """A forward over only the tokens at ``positions`` (LongTensor[batch, n], original positions,
    increasing), after a reused cache of the first ``past_length`` tokens: inside the block every
    mask is measured in original positions (:func:`probe.attention.modifiers.original_positions`), and it
    yields the forward's ``position_ids`` and ``attention_mask`` (ones: transformers would read the
    gaps as packed sequences). ``model(input_ids=ids[:, positions[0]], **inputs)`` then equals a
    forward over the whole sequence with the other tokens key-masked."""
    batch, device = positions.shape[0], positions.device
    prefix = torch.arange(past_length, device=device).expand(batch, -1)
    with original_positions(model, torch.cat([prefix, positions], dim=1)):
        yield {
            "position_ids": positions,
            "attention_mask": torch.ones(
                batch, past_length + positions.shape[1], dtype=torch.long, device=device
            ),
        }


def removed_positions(sources: Sequence[Source], removed: torch.Tensor) -> torch.Tensor:
    """Token positions of the removed sources: LongTensor[k]; ``removed`` is BoolTensor[sources]."""
    spans = [torch.arange(s.start, s.end) for s, gone in zip(sources, removed.tolist(), strict=True) if gone]
    return torch.cat(spans) if spans else torch.empty(0, dtype=torch.long)


def compaction_supported(model) -> bool:
    """Whether ``model`` takes ``position_ids``, so that a pass over the kept tokens at their original
    positions (:func:`probe.attention.modifiers.original_positions`) is exact; models that derive positions
    otherwise (ALiBi and the like) are ablated by key masking."""
    return "position_ids" in inspect.signature(hf_model(model).forward).parameters


def masked_pass(inner, ids, hidden, first: int, past, rows: torch.Tensor) -> torch.Tensor:
    """Answer-row logits [batch, rows, vocab] of the tokens from ``first`` on, ``hidden`` key-masked."""
    with mask_keys(inner, hidden):
        return inner(
            input_ids=ids[:, first:].expand(len(hidden), -1),
            **{cache_keyword(inner): past},
            use_cache=first > 0,
            logits_to_keep=rows - first,
        ).logits.float()


def compacted_pass(inner, ids, hidden, first: int, past, rows: torch.Tensor) -> torch.Tensor:
    """Answer-row logits [batch, rows, vocab] of only the kept tokens from ``first`` on, at their
    original positions; rows with fewer kept tokens than the longest are filled up with their
    first removed tokens, key-masked, so that the answer rows line up."""
    rest = ~hidden[:, first:]
    length = int(rest.sum(1).max())
    tokens = []
    for keep in rest:
        filler = (~keep).nonzero()[: length - int(keep.sum()), 0]
        tokens.append(torch.cat([keep.nonzero()[:, 0], filler]).sort().values + first)
    tokens = torch.stack(tokens).to(ids.device)  # [batch, length] original positions
    filled = hidden.to(ids.device).gather(1, tokens)
    key_mask = mask_keys(inner, hidden) if bool(filled.any()) else nullcontext()
    with compacted(inner, tokens, first) as inputs, key_mask:
        return inner(
            input_ids=ids[0, tokens],
            **inputs,
            **{cache_keyword(inner): past},
            use_cache=first > 0,
            logits_to_keep=rows - ids.shape[1] + length,  # the answer rows sit at the end
        ).logits.float()
