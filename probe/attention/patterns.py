"""Attention patterns of chosen query rows, exactly: the additive mask of those rows, softmax over
their keys (scale, soft-cap, sinks, key bias: :class:`Logits`), and A·V. What a trace captures and
what the attention function computes where sdpa does not model the model's attention."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logits:
    """How one layer turns ``q·kᵀ`` into attention: scale, optional soft-cap, sink logits and key bias.

    ``sinks``: Tensor[heads] (gpt-oss ``s_aux``), one extra logit per query head in the softmax
    denominator, so a row sums to less than 1. ``sliding_window``: the layer's own window, used
    only when transformers passes no mask. ``key_bias``: ``(bias, units)`` of a key bias the mask does
    not hold (it runs on the flash kernel), added to every row the pattern is rebuilt for
    (:func:`bias_rows`).
    """

    scaling: float
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    sliding_window: int | None = None
    key_bias: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @property
    def plain(self) -> bool:
        """Plain softmax attention: no soft-capping, no sink logits (what sdpa computes)."""
        return self.softcap is None and self.sinks is None

    def pattern(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor):
        """A[rows]: Tensor[batch, heads, rows, kv] (see :func:`pattern_rows`)."""
        return pattern_rows(query, key, rows, mask, self.scaling, self.softcap, self.sinks)


def mask_rows(
    attention_mask: torch.Tensor | None,
    rows: torch.Tensor | slice,
    q_len: int,
    kv_len: int,
    sliding_window: int | None,
    dtype: torch.dtype,
    keys: tuple[int, int] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Additive mask [batch or 1, 1, rows, keys] for the given query rows (``rows``: a LongTensor or a
    slice) and keys ``keys = (first, end)`` (default: all ``kv_len``).

    transformers passes a boolean (True = attend) or additive mask, or ``None`` when sdpa's
    own causal flag suffices; then queries are aligned to the end of the keys (as under a
    KV cache) and a sliding window, if any, keeps the last ``sliding_window`` keys.
    """
    first, end = keys or (0, kv_len)
    if attention_mask is not None:
        mask = attention_mask[:, :, rows, first:end]
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
        return mask.to(dtype)
    if isinstance(rows, slice):
        rows = torch.arange(q_len, device=device)[rows]
    query_pos = (kv_len - q_len + rows)[:, None]
    key_pos = torch.arange(first, end, device=rows.device)[None]
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    return torch.zeros(allowed.shape, dtype=dtype, device=rows.device).masked_fill(~allowed, float("-inf"))[
        None, None
    ]


def pattern_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A[rows] = softmax(cap(q_rows·Kᵀ·scale) + mask [, sink]): Tensor[batch, heads, rows, kv].

    Computed in at least fp32: for a bf16 / fp16 model the pattern is recomputed from the half
    precision q and k in fp32 and returned in fp32.

    ``query`` is [batch, heads, q, dim], ``key`` [batch, kv_heads, kv, dim]; query head h reads
    KV head h // (heads / kv_heads), as transformers' ``repeat_kv`` does, without copying K.
    ``cap(s) = softcap·tanh(s / softcap)`` when ``softcap`` is set (Gemma 2); ``sinks`` Tensor[heads]
    adds one logit per head to the softmax denominator, dropped from the result (gpt-oss).
    """
    batch, heads, _, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    dtype = torch.promote_types(query.dtype, torch.float32)  # bf16 / fp16 q and k are upcast first
    grouped = query[:, :, rows].to(dtype).reshape(batch, kv_heads, heads // kv_heads * len(rows), dim)
    scores = (grouped @ key.to(dtype).transpose(-1, -2)).view(batch, heads, len(rows), kv_len) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask.to(dtype)
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(dtype).reshape(1, heads, 1, 1).expand(batch, heads, len(rows), 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def apply_pattern(pattern: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A[rows]·V: Tensor[batch, rows, heads, dim].

    ``pattern`` is [batch, heads, rows, kv], ``value`` [batch, kv_heads, kv, dim] (GQA: as
    :func:`pattern_rows`).
    """
    batch, heads, n_rows, kv_len = pattern.shape
    kv_heads = value.shape[1]
    grouped = pattern.reshape(batch, kv_heads, heads // kv_heads * n_rows, kv_len)
    return (grouped @ value.to(pattern.dtype)).view(batch, heads, n_rows, -1).transpose(1, 2)


def row_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    rows: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits: Logits,
    block_size: int,
) -> Iterator[torch.Tensor]:
    """A[rows] ``block_size`` rows at a time, [batch, heads, block, kv] each: the transient score
    tensor stays one block's."""
    q_len, kv_len = query.shape[2], key.shape[2]
    for block in rows.split(block_size):
        mask = mask_rows(attention_mask, block, q_len, kv_len, logits.sliding_window, query.dtype)
        if logits.key_bias is not None:
            mask = mask + bias_rows(*logits.key_bias, block, q_len, kv_len, query.dtype)
        yield logits.pattern(query, key, block, mask)


def pattern_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    rows: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits: Logits,
    block_size: int,
) -> torch.Tensor:
    """A[rows] [batch, heads, rows, kv], computed by :func:`row_blocks`."""
    blocks = list(row_blocks(query, key, rows, attention_mask, logits, block_size))
    return torch.cat(blocks, dim=2) if len(blocks) > 1 else blocks[0]


def bias_rows(
    bias: torch.Tensor, units: torch.Tensor | None, rows: torch.Tensor, q_len: int, kv_len: int, dtype
) -> torch.Tensor:
    """The key bias of ``rows`` [batch or 1, 1, rows, kv]: ``bias[b, j]`` on key j from each query i > j
    (of another unit, with ``units`` LongTensor[kv]); 0 elsewhere (see
    :func:`probe.attention.modifiers.bias_keys`)."""
    later = torch.arange(kv_len, device=rows.device)[None] < (kv_len - q_len + rows)[:, None]
    if units is not None:
        units = units.to(rows.device)
        later &= units[rows][:, None] != units[None, :]
    return bias.to(device=rows.device, dtype=dtype)[:, None, None, :] * later
