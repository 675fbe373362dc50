"""The kernels behind the attention function (:func:`probe.attention._attention`): sdpa on the band of a
sliding window, exact softmax attention in row blocks where sdpa does not model the logits (soft-capping,
sinks), and a key bias as a mask (the reference) or on the CPU flash kernel in blocks of queries.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from probe.attention.flash_key_bias import Excluded, key_biased_attention, unit_runs
from probe.attention.patterns import Logits, apply_pattern, bias_rows, mask_rows, row_blocks
from probe.errors import InvalidValueError

EXACT_BLOCK = 256  # query rows per block of exact softmax attention (soft-capping, sinks)
KEY_BIAS_BLOCK = 512  # query rows per flash call of a key bias under a mask


def runs_in_bands(window: int | None, q_len: int, kv_len: int) -> bool:
    """Whether a sliding layer runs in bands of one window of queries (:func:`windowed_sdpa`)."""
    return window is not None and q_len > window and kv_len > 2 * window


def windowed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    window: int,
    dropout: float,
    scaling: float,
    **kwargs,
) -> torch.Tensor:
    """Exact sliding-window attention in blocks of ``window`` queries: [batch, q, heads, dim].

    A query at position p sees keys p − window < k ≤ p, so a block of queries needs only the keys
    from its first query's window start to its last query; sdpa runs on that band with the slice of
    the mask (which may hide more keys: key masks, padding). Cost and saved tensors grow as
    q·window instead of q·kv: at Gemma 3's window of 512 and 32K tokens, a 32× smaller band.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    offset = kv_len - q_len  # queries are the last q_len positions (KV cache)
    blocks = []
    for start in range(0, q_len, window):
        stop = min(start + window, q_len)
        first, end = max(0, offset + start - window + 1), offset + stop
        band, rows = slice(first, end), slice(start, stop)
        mask = mask_rows(attention_mask, rows, q_len, kv_len, window, query.dtype, (first, end), query.device)
        output, _ = sdpa_attention_forward(
            module, query[:, :, start:stop], key[:, :, band], value[:, :, band], mask,
            dropout=dropout, scaling=scaling, **kwargs,
        )  # fmt: skip
        blocks.append(output)
    return torch.cat(blocks, dim=1)


def attention_output(module, query, key, value, attention_mask, logits: Logits, dropout: float, **kwargs):
    """Softmax attention [batch, q, heads, dim]: the sdpa kernel (on the band of a sliding window
    where that is smaller), or exact softmax attention in row blocks for what sdpa does not model
    (soft-capping, attention sinks)."""
    scaling, window, plain = logits.scaling, logits.sliding_window, logits.plain
    if plain and runs_in_bands(window, query.shape[2], key.shape[2]):
        return windowed_sdpa(module, query, key, value, attention_mask, window, dropout, scaling, **kwargs)
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )[0]
    if dropout > 0:
        raise InvalidValueError("attention dropout is active: call model.eval() before probing attention")
    exact = torch.promote_types(query.dtype, torch.float32)
    key, value = key.to(exact), value.to(exact)  # upcast once: every block reads the same copy
    rows = torch.arange(query.shape[2], device=query.device)
    blocks = row_blocks(query, key, rows, attention_mask, logits, EXACT_BLOCK)
    # block by block: autograd keeps each block's pattern once, never a concatenated copy
    return torch.cat([apply_pattern(pattern, value) for pattern in blocks], dim=1).to(query.dtype)


def key_biased_mask(
    attention_mask: torch.Tensor | None,
    query: torch.Tensor,
    key: torch.Tensor,
    window: int | None,
    bias: torch.Tensor,
    units: torch.Tensor | None,
) -> torch.Tensor:
    """The layer's additive mask [batch or 1, 1, q, kv] with ``bias[b, j]`` on every key j from each
    later query i > j (of another unit, with ``units``): the reference of the flash kernel path."""
    q_len, kv_len = one_pass(bias, query, key)
    rows = torch.arange(q_len, device=query.device)
    mask = mask_rows(attention_mask, rows, q_len, kv_len, window, query.dtype)
    return mask + bias_rows(bias, units, rows, q_len, kv_len, query.dtype)


def one_pass(bias: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> tuple[int, int]:
    """(queries, keys) of a layer's call, checked to be one pass over the whole sequence that the key
    ``bias`` [batch or 1, kv] is for (no KV cache): else an error that says so."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len != kv_len or bias.shape[-1] != kv_len:
        raise InvalidValueError(
            f"bias_keys has a bias for {bias.shape[-1]} keys but the layer sees {q_len} queries "
            f"over {kv_len} keys: run one forward over the whole sequence, without a KV cache"
        )
    return q_len, kv_len


def key_bias_mask_elements(window: int | None, seq_len: int) -> int:
    """Elements (rows × keys) of the largest mask one flash call of a key bias builds on a layer of
    ``window`` over ``seq_len`` tokens (:func:`flash_key_biased_output`): one window of queries over its
    band on a sliding layer, else :data:`KEY_BIAS_BLOCK` rows over every key."""
    if runs_in_bands(window, seq_len, seq_len):
        return window * (2 * window - 1)
    return min(seq_len, KEY_BIAS_BLOCK) * seq_len


def flash_key_biased_output(query, key, value, attention_mask, logits: Logits, bias, units) -> torch.Tensor:
    """The key-biased attention [batch, q, heads, dim] on the CPU flash kernel, in bands of a window of
    queries on a sliding layer (:func:`windowed_sdpa`); arguments: those of
    :func:`probe.attention.flex_key_bias.key_biased_flex_attention`."""
    q_len, kv_len = query.shape[2], key.shape[2]
    device, dtype, window = query.device, query.dtype, logits.sliding_window
    runs = unit_runs(units)
    banded = runs_in_bands(window, q_len, kv_len)
    # a mask makes the kernel visit every key block: rows in blocks over their causal keys only
    causal = attention_mask is None and (window is None or q_len <= window) and not bias.any()
    step = window if banded else q_len if causal else KEY_BIAS_BLOCK
    blocks = []
    for start in range(0, q_len, step):
        stop = min(start + step, q_len)
        first = max(0, start - window + 1) if banded else 0
        band, rows = slice(first, stop), slice(start, stop)
        mask = partial(mask_rows, attention_mask, rows, q_len, kv_len, window, dtype, (first, stop), device)
        blocks.append(
            key_biased_attention(
                query[:, :, rows], key[:, :, band], value[:, :, band], (lambda: None) if causal else mask,
                bias[:, band], Excluded(start, first, runs), logits.scaling,
            )
        )  # fmt: skip
    return torch.cat(blocks, dim=1)
