"""The one attention function through which every probe reads and changes attention, and the protocol
its modifiers share.

Inside a modifier's block the model's attention runs through :func:`_attention`, registered with
transformers' ``AttentionInterface`` (its mask builder with the ``AttentionMaskInterface``) under the
name ``"longprobe"``. A :class:`Modifier` declares what it changes and implements that hook:

============  =================================================  ==========================================
changes       hook                                               modifiers
============  =================================================  ==========================================
``inputs``    ``inputs(query, key, value)`` → (q, k, v)           :func:`~probe.modifiers.lrp_attention`
``scores``    ``key_bias()`` → (bias [batch or 1, kv], units):    :func:`~probe.modifiers.bias_keys`
              ``b_j`` on key j's logit from every later query
              of another unit
``mask``      ``overlay(frame)`` → a mask function, and-ed with   :func:`~probe.modifiers.attention_window`,
              the model's own                                     :func:`~probe.modifiers.mask_keys`
``positions`` ``table(batch, kv_end, device)`` → the original     :func:`~probe.modifiers.original_positions`
              position of every key the mask then compares
``outputs``   ``outputs(output, call)`` → per-head output         :func:`~probe.capture.trace`,
              ``[batch, q, heads, dim]``, in ``stage`` order      :func:`~probe.modifiers.ablate_heads`,
                                                                  :func:`~probe.patching.patch_heads`,
                                                                  :func:`~probe.patching.record_heads`
============  =================================================  ==========================================

The attention and mask functions apply the active modifiers outermost first (output modifiers by
``stage``: a trace rebuilds its rows first, then values change, then they are recorded), so modifiers
nest in any combination; each also states its own memory term (:meth:`Modifier.memory`), which the
planner adds. A new modifier is one subclass and one context manager calling :func:`modify`.

The layer output comes from the fused ``sdpa`` kernel, exactly as without longprobe, except where the
model's attention is not plain softmax attention: logit soft-capping (Gemma 2: ``softcap·tanh(s /
softcap)`` before the mask) and sink logits (gpt-oss: one learned logit per head as an extra column of
the softmax denominator) are computed exactly, in row blocks. A key bias runs on the CPU flash
kernel, its gradient read from one extra head dimension (:mod:`probe.flash_key_bias`); elsewhere
(CUDA, soft-capping, a trace beside it) it is added to the mask, on sdpa's math kernel. On exit —
also after an exception — the model's attention implementation is restored.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, and_masks, causal_mask_function, sdpa_mask

from probe.checks import UnsupportedModelError, _bidirectional, hf_model
from probe.errors import InvalidValueError
from probe.flash_key_bias import Excluded, key_biased_attention, unit_runs
from probe.shared_state import shared_change

if TYPE_CHECKING:
    from probe.shapes import Shapes

IMPLEMENTATION = "longprobe"
INPUTS, SCORES, MASK, POSITIONS, OUTPUTS = "inputs", "scores", "mask", "positions", "outputs"
EXACT_BLOCK = 256  # query rows per block of exact softmax attention (soft-capping, sinks)
KEY_BIAS_BLOCK = 512  # query rows per flash call of a key bias under a mask


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

    @property
    def plain(self) -> bool:
        """Plain softmax attention: no soft-capping, no sink logits (what sdpa computes)."""
        return self.softcap is None and self.sinks is None

    def pattern(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor):
        """A[rows]: Tensor[batch, heads, rows, kv] (see :func:`pattern_rows`)."""
        return pattern_rows(query, key, rows, mask, self.scaling, self.softcap, self.sinks)


@dataclass(frozen=True)
class LayerCall:
    """One attention layer's call as output modifiers see it: q [batch, heads, q, dim], k and v
    [batch, kv_heads, kv, dim], the mask transformers passed (and scores modifiers changed)."""

    module: torch.nn.Module
    layer: int | None
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    logits: Logits
    dropout: float


@dataclass(frozen=True)
class MaskFrame:
    """What a mask overlay is built for: the batch, the keys' extent (in original positions under
    :func:`~probe.modifiers.original_positions`) and the device."""

    batch_size: int
    kv_end: int
    device: torch.device | str


@dataclass(eq=False)
class Modifier:
    """One change to the attention function, active inside a :func:`modify` block.

    Subclasses set ``changes`` (a subset of ``inputs``, ``scores``, ``mask``, ``positions``,
    ``outputs``) and implement the matching hooks (see the module docstring); every other hook is
    the identity. ``layers_seen`` collects the layers the modifier reached, ``masks_built`` the masks
    built while it was active, so :meth:`finish` can tell a modifier that never took effect.
    """

    changes: ClassVar[frozenset[str]] = frozenset()
    stage: ClassVar[int] = 1  # output modifiers: 0 rebuild the rows (trace), 1 change, 2 record
    layers_seen: set = field(default_factory=set, init=False, repr=False)
    masks_built: int = field(default=0, init=False, repr=False)

    def inputs(self, query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return query, key, value

    def key_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError(f"{type(self).__name__} changes scores but defines no key_bias")

    def overlay(self, frame: MaskFrame) -> Callable:
        raise NotImplementedError(f"{type(self).__name__} changes the mask but defines no overlay")

    def table(self, batch_size: int, kv_end: int, device) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} changes positions but defines no table")

    def outputs(self, output: torch.Tensor, call: LayerCall) -> torch.Tensor:
        return output

    def reach(self, layer: int | None) -> None:
        """Record that ``layer``'s attention ran with this modifier active."""
        self.layers_seen.add(layer)

    def memory(
        self, shapes: Shapes, seq_len: int, batch: int, checkpoint: bool, alongside: Sequence[Modifier]
    ) -> dict[str, int]:
        """Bytes this modifier adds to a probe call's peak, as named planner terms (none by default);
        ``alongside``: every modifier of the call, this one included."""
        return {}

    def masks_every_layer(self, shapes: Shapes, alongside: Sequence[Modifier]) -> bool:
        """Whether every layer's sdpa gets a materialized mask while this modifier is active (a key
        bias: unless it runs on the flash kernel)."""
        biased = SCORES in self.changes and not flash_key_bias(alongside, shapes.device, shapes.plain_logits)
        return biased or bool(self.changes & {MASK, POSITIONS})

    def finish(self, inner: PreTrainedModel) -> None:
        """Raise :class:`UnsupportedModelError` if the block ran but the modifier took no effect."""
        if self.changes & {MASK, POSITIONS}:
            if self.layers_seen and not self.masks_built:
                raise UnsupportedModelError(
                    f"{type(inner).__name__} builds its attention mask itself, outside transformers' "
                    "AttentionMaskInterface, so a window or key mask cannot be applied; use an architecture "
                    "that builds masks with transformers.masking_utils (Llama, Gemma 3, Qwen, ...)"
                )
        elif not self.layers_seen:
            raise not_reached(inner)


_ACTIVE: contextvars.ContextVar[tuple[Modifier, ...]] = contextvars.ContextVar("longprobe", default=())


def active_modifiers() -> tuple[Modifier, ...]:
    """The modifiers active in the current context, outermost first."""
    return _ACTIVE.get()


def _changing(active: tuple[Modifier, ...], what: str) -> list[Modifier]:
    return [modifier for modifier in active if what in modifier.changes]


@contextmanager
def with_modifiers(modifiers: tuple[Modifier, ...]) -> Iterator[None]:
    """Make exactly ``modifiers`` active for the block (a checkpointed layer's recomputation)."""
    token = _ACTIVE.set(modifiers)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def modify(model, modifier: Modifier) -> Iterator[Modifier]:
    """Make ``modifier`` active for every forward of ``model`` inside the block; yields it.

    Routes the model's attention through longprobe (restored when the last block using it leaves,
    also under threads and after an exception) and, after a block that ended normally, calls
    :meth:`Modifier.finish`.
    """
    inner = hf_model(model)
    if not inner._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(inner).__name__} does not route attention through transformers' AttentionInterface, "
            "so longprobe cannot hook it; use an architecture written in the functional attention style "
            "(Llama, Gemma 3, Qwen, Mistral, ...)"
        )

    def install() -> str:
        original = inner.config._attn_implementation
        inner.set_attn_implementation(IMPLEMENTATION)
        return original

    with with_modifiers((*active_modifiers(), modifier)):
        with shared_change(inner, "attention", install, inner.set_attn_implementation):
            yield modifier
    modifier.finish(inner)


def not_reached(inner: PreTrainedModel) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"no attention call of {type(inner).__name__} reached longprobe's attention function "
        "(did the block run a forward pass?); the model's attention may not use the AttentionInterface"
    )


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


def runs_in_bands(window: int | None, q_len: int, kv_len: int) -> bool:
    """Whether a sliding layer runs in bands of one window of queries (:func:`_windowed_sdpa`)."""
    return window is not None and q_len > window and kv_len > 2 * window


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
        mask = mask_rows(attention_mask, rows, q_len, kv_len, window, query.dtype, (first, end), query.device)
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
    active = active_modifiers()
    layer = getattr(module, "layer_idx", None)
    biases = _changing(active, SCORES)
    for modifier in _changing(active, INPUTS):
        query, key, value = modifier.inputs(query, key, value)
    if dropout == 0 and flash_key_bias(active, query.device, logits.plain):
        output = _key_biased_output(query, key, value, attention_mask, logits, biases[0])
    else:
        for modifier in biases:
            attention_mask = key_biased_mask(attention_mask, query, key, window, *modifier.key_bias())
        # CUDA's memory-efficient kernel cannot return the gradient of a mask at every length ("LSE is
        # not correctly aligned"): biased logits run on the math kernel there
        kernels = sdpa_kernel(SDPBackend.MATH) if biases and query.is_cuda else nullcontext()
        with kernels:
            output = _attention_output(module, query, key, value, attention_mask, logits, dropout, **kwargs)
    call = LayerCall(module, layer, query, key, value, attention_mask, logits, dropout)
    for modifier in sorted(_changing(active, OUTPUTS), key=lambda modifier: modifier.stage):
        output = modifier.outputs(output, call)
    for modifier in active:
        modifier.reach(layer)
    return output, None


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
    q_len, kv_len = _one_pass(bias, query, key)
    mask = mask_rows(attention_mask, slice(None), q_len, kv_len, window, query.dtype, device=query.device)
    later = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(-1)
    if units is not None:
        units = units.to(query.device)
        later &= units[:, None] != units[None, :]
    return mask + bias.to(device=query.device, dtype=query.dtype)[:, None, None, :] * later


def _one_pass(bias: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> tuple[int, int]:
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len != kv_len or bias.shape[-1] != kv_len:
        raise InvalidValueError(
            f"bias_keys has a bias for {bias.shape[-1]} keys but the layer sees {q_len} queries "
            f"over {kv_len} keys: run one forward over the whole sequence, without a KV cache"
        )
    return q_len, kv_len


def flash_key_bias(modifiers: Sequence[Modifier], device: torch.device | str, plain: bool) -> bool:
    """Whether a key bias among ``modifiers`` runs on the CPU flash kernel (:mod:`probe.flash_key_bias`):
    one bias, on CPU, plain softmax logits (no soft-cap, no sinks) and no output modifier (a trace
    rebuilds its rows from the biased mask). Otherwise the biased mask goes to sdpa's math kernel."""
    alone = len(_changing(modifiers, SCORES)) == 1 and not _changing(modifiers, OUTPUTS)
    return alone and plain and torch.device(device).type == "cpu"


def _key_biased_output(query, key, value, attention_mask, logits: Logits, modifier: Modifier) -> torch.Tensor:
    """The key-biased attention [batch, q, heads, dim] on the flash kernel, in bands of one window
    of queries on a sliding layer (as :func:`_windowed_sdpa`)."""
    bias, units = modifier.key_bias()
    q_len, kv_len = _one_pass(bias, query, key)
    device, dtype, window = query.device, query.dtype, logits.sliding_window
    bias, runs = bias.to(device), unit_runs(units)
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


def _attention_output(module, query, key, value, attention_mask, logits: Logits, dropout: float, **kwargs):
    """Softmax attention [batch, q, heads, dim]: the sdpa kernel (on the band of a sliding window
    where that is smaller), or exact softmax attention in row blocks for what sdpa does not model
    (soft-capping, attention sinks)."""
    scaling, window, plain = logits.scaling, logits.sliding_window, logits.plain
    if plain and runs_in_bands(window, query.shape[2], key.shape[2]):
        return _windowed_sdpa(module, query, key, value, attention_mask, window, dropout, scaling, **kwargs)
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
    """sdpa's mask with the active overlays and-ed in, measured in original positions.

    Under a positions modifier the mask function (causal, the model's sliding window, the overlays)
    sees each token's original position instead of its index among the keys, so a window counts
    positions, not kept tokens. A plain causal mask needs no map (the order is kept).
    """
    active = active_modifiers()
    device = kwargs.get("device", "cpu")
    for modifier in _changing(active, MASK) + _changing(active, POSITIONS):
        modifier.masks_built += 1
    kv_end, table = kv_offset + kv_length, None
    for modifier in _changing(active, POSITIONS):  # at most one (original_positions refuses a second)
        table = modifier.table(batch_size, kv_end, device)
        kv_end = int(table.max()) + 1
    overlays = [
        modifier.overlay(MaskFrame(batch_size, kv_end, device)) for modifier in _changing(active, MASK)
    ]
    if overlays:
        mask_function = and_masks(mask_function, *overlays)
    remapped = table is not None and mask_function is not causal_mask_function
    if remapped:
        mask_function = _in_original_positions(mask_function, table)
    return sdpa_mask(
        batch_size=batch_size,
        kv_length=kv_length,
        kv_offset=kv_offset,
        mask_function=mask_function,
        allow_is_causal_skip=allow_is_causal_skip and not (overlays or remapped),
        **kwargs,
    )


AttentionInterface.register(IMPLEMENTATION, _attention)
AttentionMaskInterface.register(IMPLEMENTATION, _mask)
