"""Attention with a per-key logit bias whose gradient comes out of the fused CPU flash kernel.

:func:`probe.attention.modifiers.bias_keys` adds ``b_j`` to the logit of key j from every later query of
another removal unit. Through the attention mask that needs sdpa's math kernel, which keeps each
layer's whole ``[heads, seq, seq]`` pattern and its gradient. :func:`key_biased_attention` carries
the bias in one extra head dimension instead: ``q'_i = [q_i, 1]``, ``k'_j = [k_j, b_j / scale]``, so
``scale · q'_i·k'_j = scale · q_i·k_j + b_j`` on every visible pair, and the flash kernel's key
gradient holds, in that dimension, ``scale · Σ_i ∂L/∂s_ij``: the bias's gradient, at the memory of
a plain pass (``O(seq · dim)`` a layer). The pairs that must not carry the bias (a query and the
keys of its own unit, itself included) get ``−b_j`` in the mask for the forward, and their
``∂L/∂s_ij = A_ij (dO_i·v_j − dO_i·O_i)`` is taken off in the backward, computed from the kernel's
log-sum-exp on those pairs only (the diagonal and the blocks of multi-token units).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class Excluded:
    """The visible pairs that carry no bias, for queries at positions ``rows_start + r`` over keys at
    ``keys_start + c``: the diagonal, and key before query inside one of ``runs`` (``(start, end)``
    positions of a multi-token unit)."""

    rows_start: int
    keys_start: int
    runs: tuple[tuple[int, int], ...]

    def blocks(self, rows: int, keys: int):
        """(query slice, key slice) of each run's part in this call, in local indices."""
        for start, end in self.runs:
            q = _overlap(start, end, self.rows_start, rows)
            k = _overlap(start, end, self.keys_start, keys)
            if q.stop > q.start and k.stop > k.start:
                yield q, k

    def lower(self, q: slice, k: slice, device) -> torch.Tensor:
        """BoolTensor[q, k]: key position < query position."""
        rows = torch.arange(q.start, q.stop, device=device) + self.rows_start
        keys = torch.arange(k.start, k.stop, device=device) + self.keys_start
        return keys[None] < rows[:, None]

    def diagonal(self, rows: int) -> torch.Tensor:
        """LongTensor[rows]: the local key index of each query's own position."""
        return torch.arange(rows) + self.rows_start - self.keys_start


def _overlap(start: int, end: int, offset: int, length: int) -> slice:
    """Positions [start, end) as local indices of a call covering [offset, offset + length)."""
    return slice(max(start, offset) - offset, min(end, offset + length) - offset)


def unit_runs(units: torch.Tensor | None) -> tuple[tuple[int, int], ...]:
    """The runs ``(start, end)`` of equal consecutive ``units`` (LongTensor[n]) longer than one token."""
    if units is None:
        return ()
    units = units.cpu()
    edges = torch.nonzero(units[1:] != units[:-1])[:, 0] + 1
    bounds = [0, *edges.tolist(), len(units)]
    return tuple((start, end) for start, end in zip(bounds[:-1], bounds[1:], strict=True) if end - start > 1)


def key_biased_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Callable[[], torch.Tensor | None],
    bias: torch.Tensor,
    excluded: Excluded,
    scale: float,
) -> torch.Tensor:
    """softmax(scale·q·kᵀ + mask + b_j on the pairs not ``excluded``)·v: Tensor[batch, q, heads, dim].

    ``query`` [batch, heads, q, dim], ``key`` and ``value`` [batch, kv_heads, kv, dim] (GQA: query
    head h reads KV head h // (heads / kv_heads)), ``bias`` [batch or 1, kv]. ``mask()`` builds the
    additive mask [batch or 1, 1, q, kv] (``None``: causal, queries and keys at the same positions);
    it is called again in the backward rather than kept, so a layer keeps no ``[q, kv]`` tensor.
    CPU only (the flash kernel of ``torch.nn.functional.scaled_dot_product_attention`` on CPU).
    """
    output = _KeyBiasedAttention.apply(query, key, value, bias, mask, excluded, scale)
    return output.transpose(1, 2).contiguous()


class _KeyBiasedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, bias, mask, excluded, scale):
        q_aug, k_aug, v_aug = _augmented(query, key, value, bias, scale)
        full = _with_compensation(mask(), bias, excluded, query)
        out, lse = _flash(q_aug, k_aug, v_aug, 0.0, full is None, attn_mask=full, scale=scale)
        ctx.save_for_backward(query, key, value, bias, out, lse)
        ctx.mask, ctx.excluded, ctx.scale = mask, excluded, scale
        return out[..., : value.shape[-1]]

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, bias, out, lse = ctx.saved_tensors
        mask, excluded, scale = ctx.mask(), ctx.excluded, ctx.scale
        q_aug, k_aug, v_aug = _augmented(query, key, value, bias, scale)
        full = _with_compensation(mask, bias, excluded, query)
        grad_aug = torch.cat([grad_out, grad_out.new_zeros(*grad_out.shape[:-1], 1)], dim=-1).contiguous()
        grad_q, grad_k, grad_v = _flash_backward(
            grad_aug, q_aug, k_aug, v_aug, out, lse, 0.0, full is None, attn_mask=full, scale=scale
        )
        dim = value.shape[-1]
        columns = grad_k[..., dim].float() / scale  # [batch, heads, kv]: Σ_i ∂L/∂s_ij over visible i
        columns -= _excluded_columns(query, key, value, mask, out[..., :dim], grad_out, lse, excluded, scale)
        grad_bias = columns.sum(dim=1)
        if bias.shape[0] == 1:
            grad_bias = grad_bias.sum(dim=0, keepdim=True)
        batch, kv_heads, kv = key.shape[:3]

        def per_kv_head(grad: torch.Tensor) -> torch.Tensor:
            return grad[..., :dim].reshape(batch, kv_heads, -1, kv, dim).sum(dim=2)

        grad_bias = grad_bias.to(bias.dtype)
        return grad_q[..., :dim], per_kv_head(grad_k), per_kv_head(grad_v), grad_bias, None, None, None


def _repeat(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    return tensor.repeat_interleave(heads // tensor.shape[1], dim=1)


def _augmented(query, key, value, bias, scale):
    """q' = [q, 1], k' = [k, b / scale], v' = [v, 0], keys and values repeated to the query heads."""
    batch, heads = query.shape[:2]
    key, value = _repeat(key, heads), _repeat(value, heads)
    column = (bias / scale).to(key.dtype)[:, None, :, None].expand(batch, heads, key.shape[2], 1)
    q_aug = torch.cat([query, query.new_ones(*query.shape[:-1], 1)], dim=-1)
    k_aug = torch.cat([key, column], dim=-1)
    v_aug = torch.cat([value, value.new_zeros(*value.shape[:-1], 1)], dim=-1)
    return q_aug.contiguous(), k_aug.contiguous(), v_aug.contiguous()


def _with_compensation(mask, bias, excluded: Excluded, query) -> torch.Tensor | None:
    """``mask`` with ``−b_j`` on the excluded pairs, so they carry no bias; ``None`` (the causal flag)
    when there is no mask and the bias is 0 on every excluded pair."""
    rows, keys = query.shape[2], bias.shape[1]
    if mask is None and not bias.any():
        return None
    if mask is None:
        later = torch.ones(rows, keys, dtype=torch.bool, device=query.device).triu(1)
        mask = query.new_zeros(1, 1, rows, keys).masked_fill(later, -torch.inf)
    batch = max(mask.shape[0], bias.shape[0])
    full = mask.expand(batch, 1, rows, keys).to(query.dtype).clone()
    compensation = (-bias).to(query.dtype).expand(batch, keys)
    diagonal = excluded.diagonal(rows).to(bias.device)
    full[:, 0, torch.arange(rows), diagonal] += compensation[:, diagonal]
    for q, k in excluded.blocks(rows, keys):
        lower = excluded.lower(q, k, query.device)
        full[:, 0, q, k] += compensation[:, None, k] * lower
    return full


def _excluded_columns(query, key, value, mask, out, grad_out, lse, excluded: Excluded, scale) -> torch.Tensor:
    """Σ_i ∂L/∂s_ij over the excluded pairs, Tensor[batch, heads, kv] (fp32)."""
    batch, heads, rows, dim = query.shape
    keys = key.shape[2]
    query, out, grad_out = query.float(), out.float(), grad_out.float()
    key, value = _repeat(key, heads).float(), _repeat(value, heads).float()
    delta = (grad_out * out).sum(-1)  # D_i = dO_i·O_i: [batch, heads, rows]
    columns = torch.zeros(batch, heads, keys, device=query.device)

    def logit_gradient(q: slice | torch.Tensor, k: slice | torch.Tensor, pairs: torch.Tensor | None):
        """∂L/∂s on rows q × keys k (or, with ``pairs`` None and index tensors, elementwise)."""
        if pairs is None:
            logits = (query[:, :, q] * key[:, :, k]).sum(-1) * scale
            reading = (grad_out[:, :, q] * value[:, :, k]).sum(-1)
            weight = 0.0 if mask is None else mask[:, :, q, k].float()
            attention = torch.exp(logits + weight - lse[:, :, q])
            return attention * (reading - delta[:, :, q])
        logits = query[:, :, q] @ key[:, :, k].transpose(-1, -2) * scale
        weight = 0.0 if mask is None else mask[:, :, q, k].float()
        attention = torch.exp(logits + weight - lse[:, :, q, None]).masked_fill(~pairs, 0.0)
        reading = grad_out[:, :, q] @ value[:, :, k].transpose(-1, -2)
        return attention * (reading - delta[:, :, q, None])

    diagonal = excluded.diagonal(rows).to(query.device)
    columns[:, :, diagonal] += logit_gradient(torch.arange(rows, device=query.device), diagonal, None)
    for q, k in excluded.blocks(rows, keys):
        columns[:, :, k] += logit_gradient(q, k, excluded.lower(q, k, query.device)).sum(-2)
    return columns
