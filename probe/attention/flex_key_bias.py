"""Attention with a per-key logit bias on PyTorch's FlexAttention: the key bias off the CPU.

:func:`probe.attention.modifiers.bias_keys` adds ``b_j`` to the logit of key j from every later query of
another removal unit. Through the attention mask that needs sdpa's math kernel, which keeps each layer's
whole ``[heads, seq, seq]`` pattern and its gradient (on CUDA at 16K tokens of Qwen2.5-0.5B, about 90
forward passes and 57 GiB). :func:`key_biased_flex_attention` computes the same attention with
:func:`torch.nn.attention.flex_attention.flex_attention` (Dong et al. 2024, "Flex Attention: A
Programming Model for Generating Optimized Attention Kernels"):

- the logits are ``s_ij = scale · q_i·k_j + [j < i and unit(i) ≠ unit(j)] · b_j`` (``score_mod``, with
  ``b`` a captured tensor: FlexAttention returns ``∂L/∂b_j = Σ_i ∂L/∂s_ij`` over the pairs that carry
  it, the key-removal gradient), plus the model's additive mask where it passes a float one;
- the visible pairs are ``j ≤ i``, within the layer's sliding window when it has one and transformers
  passes no mask, else where the model's mask allows (``block_mask``): blocks no query of a block sees
  are skipped, in the forward and the backward.

A query and the keys of its own unit (itself included) carry no bias, as in
:mod:`probe.attention.flash_key_bias`; here the units are compared directly, ``units[i] ≠ units[j]``
(the reference, :func:`probe.attention.patterns.bias_rows`, does the same). Query head h reads KV head
``h // (heads / kv_heads)`` (``enable_gqa``).

On CUDA the call is compiled once per process (:func:`torch.compile`, cached; a new length, window or
mask kind compiles again): FlexAttention is fused only when compiled, and then saves ``O(seq · dim)`` a
layer for the backward, as a plain pass does (its time and memory: ``python -m bench.key_bias_kernel
--device cuda``). Elsewhere it runs eagerly, on FlexAttention's dense reference implementation (the
whole score matrix: exact, no saving); eager FlexAttention refuses a backward through CPU queries, keys
or values, and :func:`probe.attention.fused_key_bias` sends it only CUDA's calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from probe.attention.patterns import Logits

Index = torch.Tensor  # a scalar int32 index tensor inside score_mod / mask_mod
# bytes per (query, key) pair that create_block_mask holds while it builds a block mask (the boolean
# mask and its blocks' counts; measured on CPU, torch 2.13, with the profiler): the planner's term
BLOCK_MASK_BYTES = 10


def key_biased_flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits: Logits,
    bias: torch.Tensor,
    units: torch.Tensor | None,
) -> torch.Tensor:
    """softmax(scale·q·kᵀ + mask + b_j on the later keys of other units)·v: Tensor[batch, q, heads, dim].

    ``query`` [batch, heads, n, dim], ``key`` and ``value`` [batch, kv_heads, n, dim] over the same n
    positions (one forward without a KV cache). ``attention_mask``: the model's mask [batch or 1, 1, n,
    n], boolean (True = attend) or additive, or ``None``: causal, within the layer's sliding window when
    it has one. ``logits``: the layer's scale and window (plain logits: no soft-cap, no sinks). ``bias``
    [batch or 1, n] on the device of ``query``; ``units`` LongTensor[n], the removal unit of each
    position, or ``None`` (every token its own unit).
    """
    n = query.shape[2]
    units = None if units is None else units.to(query.device)
    if attention_mask is None:
        block_mask = causal_block_mask(n, logits.sliding_window, query.device)
        float_mask = None
    else:
        block_mask = mask_block_mask(attention_mask)
        float_mask = None if attention_mask.dtype == torch.bool else attention_mask
    exact = torch.promote_types(bias.dtype, torch.float32)  # FlexAttention's scores are fp32 (or fp64)
    attend = _compiled() if query.is_cuda else _biased_flex
    output = attend(query, key, value, bias.to(exact), units, float_mask, block_mask, logits.scaling)
    return output.transpose(1, 2).contiguous()


def _biased_flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    units: torch.Tensor | None,
    float_mask: torch.Tensor | None,
    block_mask: BlockMask,
    scale: float,
) -> torch.Tensor:
    """FlexAttention with the key bias in ``score_mod``: Tensor[batch, heads, n, dim] (the function
    :func:`torch.compile` compiles; the score and mask functions are built inside, so one compiled
    graph serves every layer and call of the same kind)."""
    return flex_attention(
        query, key, value, score_mod=biased_scores(bias, units, float_mask), block_mask=block_mask,
        scale=scale, enable_gqa=True,
    )  # fmt: skip


def biased_scores(
    bias: torch.Tensor, units: torch.Tensor | None, float_mask: torch.Tensor | None
) -> Callable[[torch.Tensor, Index, Index, Index, Index], torch.Tensor]:
    """The ``score_mod``: ``score + b_j`` on the pairs j < i of two units (``units[i] ≠ units[j]``, all
    pairs j < i with ``units`` None), plus ``float_mask[b, 0, i, j]`` when given. ``bias`` [batch or 1,
    n]; a tensor of batch 1 serves every sequence (also ``float_mask``)."""

    def score_mod(score: torch.Tensor, b: Index, h: Index, q: Index, k: Index) -> torch.Tensor:
        carries = k < q
        if units is not None:
            carries = carries & (units[q] != units[k])
        score = score + torch.where(carries, _at(bias, b, k), 0.0)
        if float_mask is not None:
            score = score + _at(float_mask, b, 0, q, k)
        return score

    return score_mod


def _at(tensor: torch.Tensor, b: Index, *index: Index | int) -> torch.Tensor:
    """``tensor[b, *index]``, the entry of sequence ``b`` (of sequence 0 when the batch is 1: a
    broadcast); one indexing, as FlexAttention's gradient of a captured tensor needs."""
    return tensor[(0 if tensor.shape[0] == 1 else b, *index)]


@functools.lru_cache(maxsize=16)
def causal_block_mask(n: int, window: int | None, device: torch.device) -> BlockMask:
    """The block mask of ``j ≤ i`` (and ``j > i − window`` with a window) over n positions, batch and
    heads broadcast; cached per length, window and device (it holds no tensor of a call)."""

    def causal(b: Index, h: Index, q: Index, k: Index) -> torch.Tensor:
        return k <= q

    def windowed(b: Index, h: Index, q: Index, k: Index) -> torch.Tensor:
        return (k <= q) & (k > q - window)

    return create_block_mask(causal if window is None else windowed, None, None, n, n, device=device)


def mask_block_mask(attention_mask: torch.Tensor) -> BlockMask:
    """The block mask of the pairs the model's mask [batch or 1, 1, n, n] allows (True in a boolean
    mask, above −∞ in an additive one), per sequence, heads broadcast; built per call (it reads the
    call's mask: ``batch · n²`` booleans while it is built)."""
    batch, n = attention_mask.shape[0], attention_mask.shape[-1]
    if attention_mask.dtype == torch.bool:

        def allowed(b: Index, h: Index, q: Index, k: Index) -> torch.Tensor:
            return _at(attention_mask, b, 0, q, k)
    else:

        def allowed(b: Index, h: Index, q: Index, k: Index) -> torch.Tensor:
            return _at(attention_mask, b, 0, q, k) > float("-inf")

    return create_block_mask(allowed, batch, None, n, n, device=attention_mask.device)


@functools.cache
def _compiled(backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """:func:`_biased_flex` compiled, once per process and backend (the fused kernel on CUDA)."""
    return torch.compile(_biased_flex, backend=backend, fullgraph=True)
