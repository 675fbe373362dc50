"""The one attention function through which every probe reads and changes attention, and the protocol
its modifiers share.

Inside a modifier's block the model's attention runs through :func:`_attention`, registered with
transformers' ``AttentionInterface`` (its mask builder with the ``AttentionMaskInterface``) under the
name ``"longprobe"``. A :class:`Modifier` declares what it changes and implements that hook:

============  =================================================  ==========================================
changes       hook                                               modifiers (in ``probe.attention``)
============  =================================================  ==========================================
``inputs``    ``inputs(query, key, value)`` → (q, k, v)           ``modifiers.lrp_attention``
``scores``    ``key_bias()`` → (bias [batch or 1, kv], units):    ``modifiers.bias_keys``
              ``b_j`` on key j's logit from every later query
              of another unit
``mask``      ``overlay(frame)`` → a mask function, and-ed with   ``modifiers.attention_window``,
              the model's own                                     ``modifiers.mask_keys``
``positions`` ``table(batch, kv_end, device)`` → the original     ``modifiers.original_positions``
              position of every key the mask then compares
``outputs``   ``outputs(output, call)`` → per-head output         ``capture.trace``,
              ``[batch, q, heads, dim]``, in ``stage`` order      ``modifiers.ablate_heads``,
                                                                  ``patching.patch_heads``,
                                                                  ``patching.record_heads``
============  =================================================  ==========================================

The attention and mask functions apply the active modifiers outermost first (output modifiers by
``stage``: a trace rebuilds its rows first, then values change, then they are recorded), so modifiers
nest in any combination; each also states its own memory term (:meth:`Modifier.memory`), which the
planner adds. A new modifier is one subclass and one context manager calling :func:`modify`.

The layer output comes from the fused ``sdpa`` kernel, exactly as without longprobe, except where the
model's attention is not plain softmax attention: logit soft-capping (Gemma 2: ``softcap·tanh(s /
softcap)`` before the mask) and sink logits (gpt-oss: one learned logit per head as an extra column of
the softmax denominator) are computed exactly, in row blocks. A key bias runs fused
(:func:`fused_key_bias`): on CPU's flash kernel (:mod:`probe.attention.flash_key_bias`), on CUDA on
compiled FlexAttention (:mod:`probe.attention.flex_key_bias`); else (other devices, soft-capping,
sinks) it is added to the mask, on sdpa's math kernel. These kernels live in
:mod:`probe.attention.kernels`; the exact patterns of chosen rows (what a trace captures) are computed in
:mod:`probe.attention.patterns`. On exit — also after an exception — the
model's attention implementation is restored.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, and_masks, causal_mask_function, sdpa_mask

from probe.attention.flex_key_bias import key_biased_flex_attention
from probe.attention.kernels import attention_output, flash_key_biased_output, key_biased_mask, one_pass
from probe.attention.patterns import Logits
from probe.attention.shared_state import shared_change
from probe.checks import UnsupportedModelError, _bidirectional, hf_model

if TYPE_CHECKING:
    from probe.shapes import Shapes

IMPLEMENTATION = "longprobe"
INPUTS, SCORES, MASK, POSITIONS, OUTPUTS = "inputs", "scores", "mask", "positions", "outputs"
FLASH, FLEX = "flash", "flex"  # the fused kernels of a key bias (:func:`fused_key_bias`)


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
    :func:`~probe.attention.modifiers.original_positions`) and the device."""

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
        """``inputs``: q [batch, heads, q, dim], k and v [batch, kv_heads, kv, dim], changed."""
        return query, key, value

    def key_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``scores``: (bias [batch or 1, kv], units LongTensor[kv] or None), see ``bias_keys``."""
        raise NotImplementedError(f"{type(self).__name__} changes scores but defines no key_bias")

    def overlay(self, frame: MaskFrame) -> Callable:
        """``mask``: a transformers mask function ``(batch, head, q, kv) -> bool``, and-ed in."""
        raise NotImplementedError(f"{type(self).__name__} changes the mask but defines no overlay")

    def table(self, batch_size: int, kv_end: int, device) -> torch.Tensor:
        """``positions``: LongTensor[batch, kv_end], the original position of every key."""
        raise NotImplementedError(f"{type(self).__name__} changes positions but defines no table")

    def outputs(self, output: torch.Tensor, call: LayerCall) -> torch.Tensor:
        """``outputs``: the per-head output [batch, q, heads, dim] of the layer in ``call``, changed."""
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
        bias: unless it runs fused)."""
        biased = SCORES in self.changes and not fused_key_bias(alongside, shapes.device, shapes.plain_logits)
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
    """Make exactly ``modifiers`` active for the block."""
    token = _ACTIVE.set(modifiers)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("longprobe_recomputing", default=False)


def recomputing() -> bool:
    """Whether a checkpointed layer is being recomputed for the backward pass here: a modifier that
    records keeps what the forward pass recorded (:func:`recomputation`)."""
    return _RECOMPUTING.get()


@contextmanager
def recomputation(modifiers: tuple[Modifier, ...]) -> Iterator[None]:
    """The context of a checkpointed layer's recomputation (:mod:`probe.memory.checkpointing`): the
    modifiers of its forward pass, flagged (:func:`recomputing`)."""
    flag = _RECOMPUTING.set(True)
    try:
        with with_modifiers(modifiers):
            yield
    finally:
        _RECOMPUTING.reset(flag)


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
    """The error for a modifier whose block ran but never reached longprobe's attention function."""
    return UnsupportedModelError(
        f"no attention call of {type(inner).__name__} reached longprobe's attention function "
        "(did the block run a forward pass?); the model's attention may not use the AttentionInterface"
    )


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
    kernel = fused_key_bias(active, query.device, logits.plain) if dropout == 0 else None
    if kernel:
        bias, units = biases[0].key_bias()
        one_pass(bias, query, key)
        fused = flash_key_biased_output if kernel == FLASH else key_biased_flex_attention
        output = fused(query, key, value, attention_mask, logits, bias.to(query.device), units)
        logits = replace(logits, key_bias=(bias, units))  # the rows a trace rebuilds hold it too
    else:
        for modifier in biases:
            attention_mask = key_biased_mask(attention_mask, query, key, window, *modifier.key_bias())
        # CUDA's memory-efficient kernel cannot return the gradient of a mask at every length ("LSE is
        # not correctly aligned"): biased logits run on the math kernel there
        kernels = sdpa_kernel(SDPBackend.MATH) if biases and query.is_cuda else nullcontext()
        with kernels:
            output = attention_output(module, query, key, value, attention_mask, logits, dropout, **kwargs)
    call = LayerCall(module, layer, query, key, value, attention_mask, logits, dropout)
    for modifier in sorted(_changing(active, OUTPUTS), key=lambda modifier: modifier.stage):
        output = modifier.outputs(output, call)
    for modifier in active:
        modifier.reach(layer)
    return output, None


def fused_key_bias(modifiers: Sequence[Modifier], device: torch.device | str, plain: bool) -> str | None:
    """The fused kernel of one key bias among ``modifiers`` over plain logits (no soft-cap, no sinks):
    :data:`FLASH` on CPU, :data:`FLEX` on CUDA; else ``None``, the biased mask on sdpa's math kernel. A
    trace beside a fused bias rebuilds its rows with the bias (:attr:`Logits.key_bias`)."""
    one = len(_changing(modifiers, SCORES)) == 1
    return {"cpu": FLASH, "cuda": FLEX}.get(torch.device(device).type) if one and plain else None


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
