"""The capture core: one attention function through which every probe reads and changes attention.

Inside any of this module's context managers the model's attention runs through our own function,
registered with transformers' ``AttentionInterface`` (and its mask builder with the
``AttentionMaskInterface``) under the name ``"longprobe"``. Four modifiers act through it, and they
nest in any combination — a ``trace`` inside ``attention_window`` inside ``mask_keys`` sees the
window and the masked keys, and an ``ablate_heads`` around them all still zeroes its heads:

- :func:`trace` captures ``A[rows] = softmax(q_rows·Kᵀ·scale + mask)`` from the post-RoPE queries and
  keys the layer was given (GQA: per query head), with the model's own mask; with ``grad=True`` it
  replaces those rows of the output by ``A[rows]·V`` so autograd yields ∂L/∂A[rows] exactly;
- :func:`ablate_heads` zeroes chosen query heads' outputs;
- :func:`attention_window` lets every query see only its last ``window`` keys;
- :func:`mask_keys` hides chosen key positions from every other query (positions unchanged).

The layer output comes from the fused ``sdpa`` kernel, exactly as without longprobe, except where
the model's attention is not plain softmax attention: logit soft-capping (Gemma 2:
``softcap·tanh(s / softcap)`` before the mask) and sink logits (gpt-oss: one learned logit per head
as an extra column of the softmax denominator) are computed exactly, in row blocks. Memory is
O(layers·heads·rows·seq), not O(layers·heads·seq²). Tensors land in an :class:`ActivationCache`
under TransformerLens's names (``blocks.{l}.attn.hook_pattern``, ``…hook_pattern_grad``). On exit
— also after an exception — the model's attention implementation is restored.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    and_masks,
    causal_mask_function,
    sdpa_mask,
    sliding_window_overlay,
)
from transformers.modeling_layers import GradientCheckpointingLayer

from probe.checks import (
    UnsupportedModelError,
    _bidirectional,
    check_int,
    check_integers,
    check_layers,
    hf_model,
    n_layers,
)
from probe.target import Target, target_loss_of

IMPLEMENTATION = "longprobe"
HOOK_NAMES = {
    "pattern": "blocks.{layer}.attn.hook_pattern",
    "pattern_grad": "blocks.{layer}.attn.hook_pattern_grad",
}


class ActivationCache(dict):
    """Captured tensors by TransformerLens hook name, each ``[batch, heads, rows, keys]``.

    Index by full name (``cache["blocks.3.attn.hook_pattern"]``) or by ``(kind, layer)``
    (``cache["pattern", 3]``, ``cache["pattern_grad", -1]``).
    """

    def __init__(self, n_layers: int):
        super().__init__()
        self.n_layers = n_layers

    def __getitem__(self, key):
        if isinstance(key, tuple):
            kind, layer = key
            if kind not in HOOK_NAMES:
                raise KeyError(f"unknown kind {kind!r}: one of {sorted(HOOK_NAMES)}")
            key = HOOK_NAMES[kind].format(layer=layer % self.n_layers)
        if key not in self:
            held = ", ".join(sorted(self, key=lambda name: (len(name), name))) or "nothing"
            hint = " (gradients need trace(..., grad=True) and a backward)" if key.endswith("_grad") else ""
            raise KeyError(f"{key} was not captured{hint}; the cache holds: {held}")
        return super().__getitem__(key)

    def stack(self, kind: str = "pattern", layers: Sequence[int] | None = None) -> torch.Tensor:
        """Tensor[layers, heads, rows, keys] of batch element 0, in ``layers`` order."""
        layers = range(self.n_layers) if layers is None else layers
        return torch.stack([self[kind, layer][0] for layer in layers])


@dataclass(frozen=True)
class Logits:
    """How one layer turns ``q·kᵀ`` into attention: scale, optional soft-cap and sink logits.

    ``sinks``: Tensor[heads] (gpt-oss ``s_aux``), one extra logit per query head in the softmax
    denominator, so a row sums to less than 1. ``sliding_window``: the layer's own window, used
    only when transformers passes no mask.
    """

    scaling: float
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    sliding_window: int | None = None

    def pattern(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor):
        """A[rows]: Tensor[batch, heads, rows, kv] (see :func:`pattern_rows`)."""
        return pattern_rows(query, key, rows, mask, self.scaling, self.softcap, self.sinks)


@dataclass
class _Capture:
    """What one active trace captures, and the layers it has seen."""

    layers: frozenset[int]
    rows: torch.Tensor | None  # query rows to capture; None = all rows
    grad: bool
    block_size: int
    on_pattern: Callable[[int, torch.Tensor], None] | None
    cache: ActivationCache
    layers_seen: set[int] = field(default_factory=set)

    def record(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        logits: Logits,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Capture this layer's rows; ``output`` [batch, q, heads, dim], its rows replaced by A·V if grad.

        When a checkpointed layer is recomputed in the backward pass, the same tensors are computed
        again (autograd needs them) but nothing is recorded a second time.
        """
        recomputing = _RECOMPUTING.get()
        if not recomputing:
            self.layers_seen.add(layer)
        q_len = query.shape[2]
        rows = torch.arange(q_len, device=query.device) if self.rows is None else self.rows.to(query.device)
        if int(rows.max()) >= q_len:
            raise IndexError(f"captured rows {rows.tolist()} out of range for {q_len} query positions")
        grad = self.grad and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):
            pattern = _pattern_blocks(query, key, rows, attention_mask, logits, self.block_size)
        if grad:
            if not pattern.requires_grad:  # nothing upstream needs gradients: A itself is the leaf
                pattern.requires_grad_(True)
            if not recomputing:
                name = HOOK_NAMES["pattern_grad"].format(layer=layer)
                pattern.register_hook(lambda g: self.cache.__setitem__(name, g))
            output = output.index_copy(1, rows, apply_pattern(pattern, value).to(output.dtype))
        if recomputing:
            return output
        if self.on_pattern is not None:
            self.on_pattern(layer, pattern.detach())
        else:
            self.cache[HOOK_NAMES["pattern"].format(layer=layer)] = pattern.detach()
        return output


@dataclass
class _HeadAblation:
    """Query heads whose output is zeroed, by layer, and the layers that were reached."""

    heads: dict[int, list[int]]
    layers_seen: set[int] = field(default_factory=set)


@dataclass
class _KeyMask:
    """Key positions hidden from every other query: BoolTensor[batch or 1, seq], True = hidden."""

    hidden: torch.Tensor
    masks_built: int = 0
    layers_seen: set[int] = field(default_factory=set)


@dataclass
class _Window:
    """Every query sees only its last ``size`` keys (itself included)."""

    size: int
    masks_built: int = 0
    layers_seen: set[int] = field(default_factory=set)


@dataclass
class _Positions:
    """The original position of each token the forward's keys hold: LongTensor[batch or 1, kv]."""

    positions: torch.Tensor
    masks_built: int = 0
    layers_seen: set[int] = field(default_factory=set)


@dataclass
class _KeyBias:
    """``bias[b, j]`` added to the attention logit of key j from every later query i > j."""

    bias: torch.Tensor
    layers_seen: set[int] = field(default_factory=set)

    def added_to(
        self, attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        """The layer's additive mask [batch or 1, 1, q, kv] with the bias on every strictly earlier key."""
        q_len, kv_len = query.shape[2], key.shape[2]
        if q_len != kv_len or self.bias.shape[-1] != kv_len:
            raise ValueError(
                f"bias_keys has a bias for {self.bias.shape[-1]} keys but the layer sees {q_len} queries "
                f"over {kv_len} keys: run one forward over the whole sequence, without a KV cache"
            )
        mask = _mask_rows(
            attention_mask, slice(None), q_len, kv_len, window, query.dtype, device=query.device
        )
        later = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(-1)
        return mask + self.bias.to(device=query.device, dtype=query.dtype)[:, None, None, :] * later


@dataclass
class _Relevance:
    """The AttnLRP rules on the attention products: q, k gradients ÷ 4, v gradient ÷ 2."""

    layers_seen: set[int] = field(default_factory=set)


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` unchanged, its gradient multiplied by ``factor`` (the uniform rule of AttnLRP)."""
    return _ScaleGradient.apply(x, factor)


@dataclass(frozen=True)
class _Modifiers:
    """Everything active in the current context, innermost last."""

    captures: tuple[_Capture, ...] = ()
    ablations: tuple[_HeadAblation, ...] = ()
    windows: tuple[_Window, ...] = ()
    key_masks: tuple[_KeyMask, ...] = ()
    positions: tuple[_Positions, ...] = ()
    key_biases: tuple[_KeyBias, ...] = ()
    relevance: tuple[_Relevance, ...] = ()

    def reached(self, layer: int | None) -> None:
        """Record that ``layer``'s attention ran under these modifiers."""
        for modifier in (*self.windows, *self.key_masks, *self.positions, *self.key_biases, *self.relevance):
            modifier.layers_seen.add(layer)
        for ablation in self.ablations:
            if layer in ablation.heads:
                ablation.layers_seen.add(layer)


_NONE = _Modifiers()
_ACTIVE: contextvars.ContextVar[_Modifiers | None] = contextvars.ContextVar("longprobe", default=None)


def _active() -> _Modifiers:
    return _ACTIVE.get() or _NONE


def masks_active() -> bool:
    """Whether an attention window, key mask, key bias or position map is active here (every layer
    may then get a mask)."""
    active = _active()
    return bool(active.windows or active.key_masks or active.positions or active.key_biases)


_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("longprobe_recomputing", default=False)


@contextmanager
def _recomputing(modifiers: _Modifiers | None) -> Iterator[None]:
    """The context of a checkpointed layer's recomputation: the modifiers of its forward, flagged."""
    token, flag = _ACTIVE.set(modifiers), _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(flag)
        _ACTIVE.reset(token)


def _mask_rows(
    attention_mask: torch.Tensor | None,
    rows: torch.Tensor,
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


def _pattern_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    rows: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits: Logits,
    block_size: int,
) -> torch.Tensor:
    """A[rows] computed ``block_size`` rows at a time, bounding the transient score tensor."""
    q_len, kv_len = query.shape[2], key.shape[2]
    blocks = []
    for block in rows.split(block_size):
        mask = _mask_rows(attention_mask, block, q_len, kv_len, logits.sliding_window, query.dtype)
        blocks.append(logits.pattern(query, key, block, mask))
    return torch.cat(blocks, dim=2) if len(blocks) > 1 else blocks[0]


def _windowed_sdpa(
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
        mask = _mask_rows(
            attention_mask, rows, q_len, kv_len, window, query.dtype, (first, end), query.device
        )
        output, _ = sdpa_attention_forward(
            module, query[:, :, start:stop], key[:, :, band], value[:, :, band], mask,
            dropout=dropout, scaling=scaling, **kwargs,
        )  # fmt: skip
        blocks.append(output)
    return torch.cat(blocks, dim=1)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"longprobe"`` (see the module docstring)."""
    if kwargs.get("position_bias") is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__} adds a position bias to its attention logits, which longprobe does not "
            "model; use an architecture with rotary or learned absolute positions"
        )
    if getattr(module, "is_causal", True) is False:  # an encoder inside a larger model (a vision tower)
        raise _bidirectional(module)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    window = kwargs.get("sliding_window")
    logits = Logits(scaling, softcap, s_aux, window)
    active = _active()
    for key_bias in active.key_biases:
        attention_mask = key_bias.added_to(attention_mask, query, key, window)
    if active.relevance:  # q·kᵀ and A·V are products of two inputs: the uniform rule
        query, key, value = scale_gradient(query, 0.25), scale_gradient(key, 0.25), scale_gradient(value, 0.5)
    # CUDA's memory-efficient kernel cannot return the gradient of a mask at every length ("LSE is not
    # correctly aligned"): a key bias runs on the math kernel there
    kernels = sdpa_kernel(SDPBackend.MATH) if active.key_biases and query.is_cuda else nullcontext()
    with kernels:
        output = _attention_output(module, query, key, value, attention_mask, logits, dropout, **kwargs)
    layer = getattr(module, "layer_idx", None)
    active.reached(layer)
    captures = [c for c in active.captures if layer in c.layers]
    if captures and dropout > 0:
        raise ValueError("attention dropout is active: call model.eval() before capturing attention")
    if sum(c.grad for c in captures) > 1 and torch.is_grad_enabled():
        raise ValueError("two traces with grad=True capture the same layer; use one trace with all rows")
    for capture in captures:
        output = capture.record(layer, query, key, value, attention_mask, logits, output)
    return _ablate(output, layer, active), None


def _attention_output(module, query, key, value, attention_mask, logits: Logits, dropout: float, **kwargs):
    """Softmax attention [batch, q, heads, dim]: the sdpa kernel (on the band of a sliding window
    where that is smaller), or exact softmax attention in row blocks for what sdpa does not model
    (soft-capping, attention sinks)."""
    scaling, window = logits.scaling, logits.sliding_window
    plain = logits.softcap is None and logits.sinks is None
    if plain and window and query.shape[2] > window and key.shape[2] > 2 * window:
        return _windowed_sdpa(module, query, key, value, attention_mask, window, dropout, scaling, **kwargs)
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )[0]
    if dropout > 0:
        raise ValueError("attention dropout is active: call model.eval() before probing attention")
    rows = torch.arange(query.shape[2], device=query.device)
    pattern = _pattern_blocks(query, key, rows, attention_mask, logits, 256)
    return apply_pattern(pattern, value).to(value.dtype)


def _ablate(output: torch.Tensor, layer: int | None, active: _Modifiers) -> torch.Tensor:
    """``output`` [batch, q, heads, dim] with the heads ablated in ``layer`` set to zero."""
    heads = sorted({h for ablation in active.ablations for h in ablation.heads.get(layer, ())})
    if not heads:
        return output
    keep = torch.ones(output.shape[2], dtype=output.dtype, device=output.device)
    keep[heads] = 0
    return output * keep[:, None]


def _visible_keys(hidden: torch.Tensor, batch_size: int, kv_end: int, device) -> Callable:
    """Mask function: key ``kv`` is visible to query ``q`` unless hidden (a hidden key still sees itself)."""
    if hidden.shape[0] not in (1, batch_size):
        raise ValueError(f"mask_keys got masks for {hidden.shape[0]} sequences, the forward has {batch_size}")
    if hidden[:, kv_end:].any():
        beyond = (hidden[:, kv_end:].any(0).nonzero().flatten() + kv_end).tolist()[:8]
        raise IndexError(f"mask_keys hides positions {beyond} beyond the {kv_end} tokens the forward holds")
    padded = torch.zeros(batch_size, max(kv_end, hidden.shape[1]), dtype=torch.bool, device=device)
    padded[:, : hidden.shape[1]] = hidden.to(device)

    def visible(batch_idx, head_idx, q_idx, kv_idx):
        return ~padded[batch_idx, kv_idx] | (q_idx == kv_idx)

    return visible


def _position_table(positions: torch.Tensor, batch_size: int, kv_end: int, device) -> torch.Tensor:
    """``positions`` LongTensor[batch or 1, kv] as [batch, kv] on ``device``, checked to cover the keys."""
    if positions.shape[0] not in (1, batch_size):
        raise ValueError(
            f"original_positions got positions for {positions.shape[0]} sequences, "
            f"the forward has {batch_size}"
        )
    if positions.shape[1] < kv_end:
        raise ValueError(
            f"original_positions holds {positions.shape[1]} positions but the keys reach index {kv_end - 1}: "
            "give one position for every token of the cache and of the input"
        )
    return positions.to(device).expand(batch_size, -1)


def _in_original_positions(mask_function: Callable, table: torch.Tensor) -> Callable:
    """``mask_function`` evaluated at the original positions ``table[b, index]`` of query and key."""

    def remapped(batch_idx, head_idx, q_idx, kv_idx):
        return mask_function(batch_idx, head_idx, table[batch_idx, q_idx], table[batch_idx, kv_idx])

    return remapped


def _mask(
    *,
    batch_size: int,
    kv_length: int,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    allow_is_causal_skip: bool = True,
    **kwargs,
):
    """sdpa's mask with the active windows and key masks overlaid, measured in original positions.

    Under :func:`original_positions` the mask function (causal, the model's sliding window, the
    overlays) sees each token's original position instead of its index among the keys, so a window
    counts positions, not kept tokens. A plain causal mask needs no map (the order is kept).
    """
    active = _active()
    device = kwargs.get("device", "cpu")
    table = None
    if active.positions:
        compaction = active.positions[-1]
        compaction.masks_built += 1
        table = _position_table(compaction.positions, batch_size, kv_offset + kv_length, device)
    kv_end = int(table.max()) + 1 if table is not None else kv_offset + kv_length
    overlaid = bool(active.windows or active.key_masks)
    for window in active.windows:
        window.masks_built += 1
        mask_function = and_masks(mask_function, sliding_window_overlay(window.size))
    for key_mask in active.key_masks:
        key_mask.masks_built += 1
        mask_function = and_masks(mask_function, _visible_keys(key_mask.hidden, batch_size, kv_end, device))
    if table is not None and (overlaid or mask_function is not causal_mask_function):
        mask_function = _in_original_positions(mask_function, table)
        overlaid = True
    if overlaid:
        allow_is_causal_skip = False
    return sdpa_mask(
        batch_size=batch_size,
        kv_length=kv_length,
        kv_offset=kv_offset,
        mask_function=mask_function,
        allow_is_causal_skip=allow_is_causal_skip,
        **kwargs,
    )


AttentionInterface.register(IMPLEMENTATION, _attention)
AttentionMaskInterface.register(IMPLEMENTATION, _mask)


_SHARED_LOCK = threading.Lock()
_SHARED: dict[tuple[int, str], list] = {}  # (id(model), what) -> [blocks inside, what restore needs]


@contextmanager
def _shared_change(
    model: torch.nn.Module, what: str, apply: Callable[[], Any], restore: Callable[[Any], None]
):
    """Change ``model`` once for every block that needs the change at the same time, and undo it when
    the last one leaves — also when the blocks run in several threads or nest, also after an
    exception. ``apply()`` makes the change and returns what ``restore`` needs to undo it.

    The concurrency contract: probes may run on one model from several threads at once; the model's
    attention implementation, train/eval mode and every ``requires_grad`` are longprobe's while any
    probe runs, and exactly as found once the last one has returned.
    """
    key = (id(model), what)
    with _SHARED_LOCK:
        if key in _SHARED:
            _SHARED[key][0] += 1
        else:
            _SHARED[key] = [1, apply()]
    try:
        yield
    finally:
        with _SHARED_LOCK:
            entry = _SHARED[key]
            entry[0] -= 1
            if entry[0] == 0:
                del _SHARED[key]
                restore(entry[1])


@contextmanager
def frozen_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Turn off parameter gradients (and dropout) for the block; restore both afterwards
    (thread-safe and re-entrant, see :func:`_shared_change`)."""

    def freeze() -> tuple[list, bool]:
        saved = [(p, p.requires_grad) for p in model.parameters()], model.training
        model.requires_grad_(False)
        model.eval()
        return saved

    def thaw(saved: tuple[list, bool]) -> None:
        flags, was_training = saved
        for param, flag in flags:
            param.requires_grad_(flag)
        model.train(was_training)

    with _shared_change(model, "frozen", freeze, thaw):
        yield


@contextmanager
def _modified(inner: PreTrainedModel, **added) -> Iterator[None]:
    """Add modifiers for the block, route ``inner``'s attention through longprobe, restore both after."""
    if not inner._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(inner).__name__} does not route attention through transformers' AttentionInterface, "
            "so longprobe cannot hook it; use an architecture written in the functional attention style "
            "(Llama, Gemma 3, Qwen, Mistral, ...)"
        )
    active = _active()
    token = _ACTIVE.set(replace(active, **{name: (*getattr(active, name), m) for name, m in added.items()}))

    def install() -> str:
        original = inner.config._attn_implementation
        inner.set_attn_implementation(IMPLEMENTATION)
        return original

    try:
        with _shared_change(inner, "attention", install, inner.set_attn_implementation):
            yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def trace(
    model,
    rows: Sequence[int] | torch.Tensor | None = None,
    layers: Sequence[int] | None = None,
    grad: bool = False,
    block_size: int = 256,
    on_pattern: Callable[[int, torch.Tensor], None] | None = None,
) -> Iterator[ActivationCache]:
    """Capture attention rows (and their gradients) of every forward run inside the block.

    Args:
        model: a Hugging Face causal LM (a TransformerBridge is refused: pass the HF model it wraps).
        rows: query positions to capture (indices into the forward's query axis); ``None`` = all.
        layers: layers to capture (negative indices allowed); ``None`` = all.
        grad: also compute the captured rows' output as A·V so ∂L/∂A lands in the cache
            under ``blocks.{l}.attn.hook_pattern_grad`` when you call ``backward``.
        block_size: rows computed per step, bounding the transient score tensor.
        on_pattern: if given, called as ``on_pattern(layer, pattern)`` with each layer's
            Tensor[batch, heads, rows, kv] instead of storing it (streaming consumers).

    Yields the :class:`ActivationCache`. Raises :class:`UnsupportedModelError` if the
    model's attention never reached the interface.
    """
    inner = hf_model(model)
    chosen = check_layers(inner, layers)
    check_int(block_size, "block_size", minimum=1)
    if rows is not None:
        rows = check_integers(rows, "rows").reshape(-1)
        if rows.numel() == 0 or int(rows.min()) < 0:
            raise IndexError(f"rows must be non-empty, non-negative query positions, got {rows.tolist()}")
    capture = _Capture(
        layers=frozenset(chosen),
        rows=rows,
        grad=grad,
        block_size=block_size,
        on_pattern=on_pattern,
        cache=ActivationCache(n_layers(inner)),
    )
    with _modified(inner, captures=capture):
        yield capture.cache
    if capture.layers and not capture.layers_seen:
        raise _not_reached(inner)


@contextmanager
def ablate_heads(model, heads: Iterable[tuple[int, int]]) -> Iterator[None]:
    """Zero the output of the given ``(layer, query head)`` pairs in every forward inside the block.

    The head's contribution to the residual stream (its slice of the input to the output
    projection) is removed, the usual "mask a head" ablation (Wu et al. 2024 instead make the
    head's attention uniform). Works with ``model.generate`` and with the other modifiers.
    """
    inner = hf_model(model)
    config = inner.config.get_text_config()
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        (layer,) = check_layers(inner, [check_int(layer, "the layer of a (layer, head) pair")])
        if not 0 <= check_int(head, "the head of a (layer, head) pair") < config.num_attention_heads:
            raise IndexError(f"head {head} out of range for {config.num_attention_heads} query heads a layer")
        by_layer.setdefault(layer, []).append(head)
    ablation = _HeadAblation(by_layer)
    with _modified(inner, ablations=ablation):
        yield
    if by_layer and not ablation.layers_seen:
        raise _not_reached(inner)


@contextmanager
def attention_window(model, window: int | None) -> Iterator[None]:
    """Limit every attention layer of ``model`` to the last ``window`` tokens inside the block.

    A model variant with shorter reach (the receptive field still grows by ``window`` per layer, as in
    sliding-window models); layers that already have a sliding window keep the smaller one. Works
    with generation (KV cache) and with the other modifiers. ``window=None``: unchanged.
    """
    if window is None:
        yield
        return
    inner = hf_model(model)
    modifier = _Window(check_int(window, "window", minimum=1))
    with _modified(inner, windows=modifier):
        yield
    _check_mask_built(inner, modifier)


@contextmanager
def mask_keys(model, positions: Sequence[int] | torch.Tensor) -> Iterator[None]:
    """Hide the keys at ``positions`` from every query of every layer inside the block.

    The ablation of context tokens by key masking: the hidden tokens stay in the input, every
    other token keeps its position (RoPE unchanged), and no other query can attend to them; each
    hidden token still attends to itself, so its own row stays finite. ``positions``: token
    positions hidden in every sequence of the batch (LongTensor[k] or a list), or a BoolTensor[batch,
    seq] (True = hidden) with one mask per sequence. Works with sliding windows, GQA, KV caches
    (``generate``) and the other modifiers.
    """
    if torch.is_tensor(positions) and positions.dtype == torch.bool:
        if positions.ndim != 2:
            raise ValueError(
                "a boolean key mask must be [batch, seq] (True = hidden), got shape "
                f"{tuple(positions.shape)}; for a list of positions pass integers"
            )
        hidden = positions
    else:
        positions = check_integers(positions, "key positions").reshape(-1)
        if positions.numel() and int(positions.min()) < 0:
            raise IndexError(f"key positions must be non-negative, got {positions.tolist()}")
        hidden = torch.zeros(1, int(positions.max()) + 1 if positions.numel() else 0, dtype=torch.bool)
        hidden[0, positions] = True
    inner = hf_model(model)
    context = getattr(inner.config.get_text_config(), "max_position_embeddings", None)
    if context is not None and hidden.shape[1] > context:
        raise IndexError(f"key positions up to {hidden.shape[1] - 1} exceed the model's context of {context}")
    modifier = _KeyMask(hidden)
    with _modified(inner, key_masks=modifier):
        yield
    _check_mask_built(inner, modifier)


@contextmanager
def original_positions(model, positions: torch.Tensor) -> Iterator[None]:
    """Measure every attention mask inside the block in original token positions (compaction).

    ``positions``: LongTensor[batch or 1, kv], the original position of each token the keys hold
    (a reused prefix cache first, then the input), increasing along each row. Causal order, the
    model's sliding windows, :func:`attention_window` and :func:`mask_keys` (whose positions are then
    original positions) all compare these, not indices among the keys. Run the model on the kept
    tokens with ``position_ids`` set to their positions and an ``attention_mask`` of ones (without
    one, transformers would read the gaps as packed sequences): the result equals a forward over
    the whole sequence with the left-out tokens key-masked — a hidden key contributes nothing and
    nothing reads a hidden token's state — at the cost of the kept tokens only.
    """
    positions = torch.as_tensor(positions)
    if positions.dtype in (torch.bool,) or positions.is_floating_point():
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    if positions.ndim == 1:
        positions = positions[None]
    if positions.ndim != 2 or not bool((positions.diff(dim=1) > 0).all()):
        raise ValueError("positions must be LongTensor[batch or 1, kv], strictly increasing along each row")
    inner = hf_model(model)
    if _active().positions:
        raise ValueError("original_positions is already active: the positions of one forward are one map")
    modifier = _Positions(positions.long())
    with _modified(inner, positions=modifier):
        yield
    _check_mask_built(inner, modifier)


@contextmanager
def bias_keys(model, bias: torch.Tensor) -> Iterator[None]:
    """Add ``bias[b, j]`` to the attention logit of key j from every later query (i > j), in every
    layer and head, inside the block.

    ``bias``: Tensor[batch or 1, seq] (or Tensor[seq]) over the tokens of one forward without a KV
    cache. At ``bias = 0`` the model is unchanged; ``bias → −∞`` removes key j from every later
    query, so with ``bias.requires_grad`` the gradient ∂f/∂bias_j is a first-order estimate of
    removing token j everywhere, indirect paths included (see
    :func:`probe.attribution.key_removal_gradient`). Works with checkpointing, sliding windows,
    captures and the other modifiers (a trace sees the biased attention).
    """
    if not torch.is_tensor(bias) or not bias.is_floating_point():
        raise TypeError("bias must be a floating-point tensor [batch or 1, seq]")
    bias = bias[None] if bias.ndim == 1 else bias
    if bias.ndim != 2:
        raise ValueError(f"bias must be Tensor[batch or 1, seq], got shape {tuple(bias.shape)}")
    inner = hf_model(model)
    modifier = _KeyBias(bias)
    with _modified(inner, key_biases=modifier):
        yield
    if not modifier.layers_seen:
        raise _not_reached(inner)


@contextmanager
def lrp_attention(model) -> Iterator[None]:
    """Inside the block the attention's backward follows AttnLRP's uniform rule (Achtibat et al. 2024,
    eq. 7): the gradients of queries and keys are divided by 4, those of values by 2; the forward is
    unchanged. Part of :func:`probe.lrp.lrp_rules`."""
    inner = hf_model(model)
    modifier = _Relevance()
    with _modified(inner, relevance=modifier):
        yield
    if not modifier.layers_seen:
        raise _not_reached(inner)


@contextmanager
def checkpointed(model, enabled: bool = True) -> Iterator[None]:
    """Recompute every decoder layer in the backward pass instead of keeping its activations.

    Inside the block each decoder layer (every transformers ``GradientCheckpointingLayer``) runs
    under ``torch.utils.checkpoint`` (non-reentrant) whenever gradients are on, also in eval mode:
    activation memory is the layer inputs plus one layer's working set, O(seq·hidden·layers),
    instead of every layer's intermediates. The recomputation runs with the modifiers that were
    active in the forward pass (traces, masks, windows, ablations) and records nothing twice, so
    captured rows and their gradients equal the plain pass. Forward passes must not write a KV
    cache (``use_cache=False``). ``enabled=False``: a no-op. The layers are restored on exit.
    """
    if not enabled:
        yield
        return
    inner = hf_model(model)
    layers = [module for module in inner.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not layers:
        raise UnsupportedModelError(
            f"{type(inner).__name__} has no transformers GradientCheckpointingLayer to checkpoint; "
            "run the probe with checkpoint=False"
        )
    wrapped = [layer for layer in layers if not getattr(vars(layer).get("forward"), "checkpointing", False)]
    for layer in wrapped:  # an enclosing block's layers stay as they are, and are its to restore
        layer.forward = _checkpointing(layer.forward)
    try:
        yield
    finally:
        for layer in wrapped:
            vars(layer).pop("forward", None)


def _checkpointing(forward: Callable) -> Callable:
    """``forward`` run under non-reentrant checkpointing when gradients are on."""

    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if kwargs.get("past_key_values") is not None:
            raise ValueError("checkpointing cannot write a KV cache; call the model with use_cache=False")
        modifiers = _ACTIVE.get()
        return checkpoint(
            forward,
            *args,
            use_reentrant=False,
            context_fn=lambda: (nullcontext(), _recomputing(modifiers)),
            **kwargs,
        )

    checkpointed_forward.checkpointing = True
    return checkpointed_forward


def _check_mask_built(inner: PreTrainedModel, modifier: _Window | _KeyMask | _Positions) -> None:
    """Raise if attention ran in the block but the model never asked longprobe for its mask."""
    if modifier.layers_seen and not modifier.masks_built:
        raise UnsupportedModelError(
            f"{type(inner).__name__} builds its attention mask itself, outside transformers' "
            "AttentionMaskInterface, so a window or key mask cannot be applied; use an architecture "
            "that builds masks with transformers.masking_utils (Llama, Gemma 3, Qwen, ...)"
        )


def _not_reached(inner: PreTrainedModel) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"no attention call of {type(inner).__name__} reached longprobe's attention function "
        "(did the block run a forward pass?); the model's attention may not use the AttentionInterface"
    )


def target_loss(
    model,
    input_ids: torch.Tensor,
    target_positions: torch.Tensor,
    target: Target | None = None,
    **forward_kwargs,
) -> torch.Tensor:
    """−target / k for the k tokens at ``target_positions``, predicted from rows ``t − 1`` (the
    default target: their mean cross-entropy; see :mod:`probe.target`).

    Only the needed rows are projected to the vocabulary (``logits_to_keep``), never the
    full ``[seq, vocab]`` logits. ``forward_kwargs`` may pass ``inputs_embeds`` instead of ids.
    """
    inner = hf_model(model)
    if "inputs_embeds" not in forward_kwargs:
        forward_kwargs["input_ids"] = input_ids
    logits = inner(use_cache=False, logits_to_keep=target_positions - 1, **forward_kwargs).logits
    return target_loss_of(target, logits[0], input_ids[0, target_positions])
