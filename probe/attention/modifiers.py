"""The interventions on attention: each a :class:`~probe.attention.Modifier` and the context manager
that makes it active (see :mod:`probe.attention` for the protocol). They nest in any combination — a
``trace`` inside ``attention_window`` inside ``mask_keys`` sees the window and the masked keys, and an
``ablate_heads`` around them all still zeroes its heads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.masking_utils import sliding_window_overlay

from probe.attention import (
    FLEX,
    INPUTS,
    MASK,
    OUTPUTS,
    POSITIONS,
    SCORES,
    LayerCall,
    MaskFrame,
    Modifier,
    active_modifiers,
    fused_key_bias,
    modify,
    not_reached,
)
from probe.attention.flex_key_bias import BLOCK_MASK_BYTES
from probe.attention.kernels import key_bias_mask_elements
from probe.checks import check_int, check_integers, check_layers, hf_model, model_context
from probe.errors import InvalidTypeError, InvalidValueError, OutOfRangeError

if TYPE_CHECKING:
    from probe.shapes import Shapes


@dataclass(eq=False)
class HeadModifier(Modifier):
    """An output modifier of chosen query heads, by layer: ``heads`` {layer: [head, ...]}. It has taken
    effect once one of those layers ran."""

    changes = frozenset({OUTPUTS})
    heads: dict[int, list[int]]

    def reach(self, layer: int | None) -> None:
        if layer in self.heads:
            self.layers_seen.add(layer)

    def finish(self, inner) -> None:
        if self.heads and not self.layers_seen:
            raise not_reached(inner)


@dataclass(eq=False)
class HeadAblation(HeadModifier):
    """Query heads whose output is zeroed."""

    def outputs(self, output: torch.Tensor, call: LayerCall) -> torch.Tensor:
        heads = self.heads.get(call.layer)
        if not heads:
            return output
        keep = torch.ones(output.shape[2], dtype=output.dtype, device=output.device)
        keep[heads] = 0
        return output * keep[:, None]


@dataclass(eq=False)
class Window(Modifier):
    """Every query sees only its last ``size`` keys (itself included)."""

    changes = frozenset({MASK})
    size: int

    def overlay(self, frame: MaskFrame):
        return sliding_window_overlay(self.size)


@dataclass(eq=False)
class KeyMask(Modifier):
    """Key positions hidden from every other query: ``hidden`` BoolTensor[batch or 1, seq], True = hidden."""

    changes = frozenset({MASK})
    hidden: torch.Tensor

    def overlay(self, frame: MaskFrame):
        """Key ``kv`` is visible to query ``q`` unless hidden (a hidden key still sees itself)."""
        hidden, batch_size, kv_end = self.hidden, frame.batch_size, frame.kv_end
        if hidden.shape[0] not in (1, batch_size):
            raise InvalidValueError(
                f"mask_keys got masks for {hidden.shape[0]} sequences, the forward has {batch_size}"
            )
        if hidden[:, kv_end:].any():
            beyond = (hidden[:, kv_end:].any(0).nonzero().flatten() + kv_end).tolist()[:8]
            raise OutOfRangeError(
                f"mask_keys hides positions {beyond} beyond the {kv_end} tokens the forward holds"
            )
        padded = torch.zeros(batch_size, max(kv_end, hidden.shape[1]), dtype=torch.bool, device=frame.device)
        padded[:, : hidden.shape[1]] = hidden.to(frame.device)

        def visible(batch_idx, head_idx, q_idx, kv_idx):
            return ~padded[batch_idx, kv_idx] | (q_idx == kv_idx)

        return visible


@dataclass(eq=False)
class OriginalPositions(Modifier):
    """The original position of each token the forward's keys hold: ``positions``
    LongTensor[batch or 1, kv]."""

    changes = frozenset({POSITIONS})
    positions: torch.Tensor

    def table(self, batch_size: int, kv_end: int, device) -> torch.Tensor:
        """The positions as [batch, kv] on ``device``, checked to cover the keys."""
        positions = self.positions
        if positions.shape[0] not in (1, batch_size):
            raise InvalidValueError(
                f"original_positions got positions for {positions.shape[0]} sequences, "
                f"the forward has {batch_size}"
            )
        if positions.shape[1] < kv_end:
            raise InvalidValueError(
                f"original_positions holds {positions.shape[1]} positions but the keys reach index "
                f"{kv_end - 1}: "
                "give one position for every token of the cache and of the input"
            )
        return positions.to(device).expand(batch_size, -1)


@dataclass(eq=False)
class KeyBias(Modifier):
    """``bias[b, j]`` added to the attention logit of key j from every later query i > j; with
    ``units`` (LongTensor[seq], a removal unit per token) only from later queries of another unit."""

    changes = frozenset({SCORES})
    bias: torch.Tensor
    units: torch.Tensor | None = None

    def key_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.bias, self.units

    def memory(
        self, shapes: Shapes, seq_len: int, batch: int, checkpoint: bool, alongside: Sequence[Modifier]
    ) -> dict[str, int]:
        """With a gradient on the bias (kernels: :func:`probe.attention.fused_key_bias`): on the flash
        kernel one call's masks, the model's and the compensated one, and a boolean one (``m·(2·a + 1)``
        for the largest call's ``m`` elements, :func:`probe.attention.kernels.key_bias_mask_elements`:
        ``512·n`` on a full layer); on FlexAttention what building a block mask holds
        (:data:`~probe.attention.flex_key_bias.BLOCK_MASK_BYTES` per pair, ``n²`` pairs a sequence);
        else sdpa's math kernel keeps each layer's full attention and the ``[n, n]``
        later-key mask (``2·H·n²·a + n²``, every layer; one at a time checkpointed), and its backward
        the fp32 probabilities' gradient of one layer (``2·H·n²·4``)."""
        if not self.bias.requires_grad:
            return {}
        kernel = fused_key_bias(alongside, shapes.device, shapes.plain_logits)
        if kernel == FLEX:
            return {"key_bias": batch * BLOCK_MASK_BYTES * seq_len**2}
        if kernel:
            elements = max(key_bias_mask_elements(window, seq_len) for window in shapes.windows)
            return {"key_bias": batch * elements * (2 * shapes.act_bytes + 1)}
        per_layer = 2 * shapes.heads * seq_len**2 * shapes.act_bytes + seq_len**2
        kept = 1 if checkpoint else shapes.layers
        return {"key_bias": batch * (kept * per_layer + 8 * shapes.heads * seq_len**2)}


@dataclass(eq=False)
class Relevance(Modifier):
    """The AttnLRP rules on the attention products: q, k gradients ÷ 4, v gradient ÷ 2."""

    changes = frozenset({INPUTS})

    def inputs(self, query, key, value):
        return scale_gradient(query, 0.25), scale_gradient(key, 0.25), scale_gradient(value, 0.5)


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


@contextmanager
def ablate_heads(model, heads: Iterable[tuple[int, int]]) -> Iterator[None]:
    """Zero the output of the given ``(layer, query head)`` pairs in every forward inside the block.

    The head's contribution to the residual stream (its slice of the input to the output
    projection) is removed, the usual "mask a head" ablation (Wu et al. 2024 instead make the
    head's attention uniform). Works with ``model.generate`` and with the other modifiers.
    """
    inner = hf_model(model)
    by_layer = check_heads(inner, heads)
    with modify(inner, HeadAblation(by_layer)):
        yield


def check_heads(inner, heads: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
    """``(layer, query head)`` pairs as {layer: [head, ...]}, each checked against the model."""
    config = inner.config.get_text_config()
    wrong = "heads must be a list of (layer, head) pairs"
    if not (isinstance(heads, (list, tuple, set)) or torch.is_tensor(heads)):
        raise InvalidTypeError(f"{wrong}, got {heads!r}")
    pairs = heads.tolist() if torch.is_tensor(heads) else list(heads)
    if len(pairs) == 2 and all(isinstance(x, int) for x in pairs):
        raise InvalidTypeError(f"{wrong}, got one pair: pass [{tuple(pairs)!r}]")
    bad = [pair for pair in pairs if not isinstance(pair, (list, tuple)) or len(pair) != 2]
    if bad:
        raise InvalidTypeError(f"{wrong}, got the entry {bad[0]!r}")
    by_layer: dict[int, list[int]] = {}
    for layer, head in pairs:
        (layer,) = check_layers(inner, [check_int(layer, "the layer of a (layer, head) pair")])
        if not 0 <= check_int(head, "the head of a (layer, head) pair") < config.num_attention_heads:
            raise OutOfRangeError(
                f"head {head} out of range for {config.num_attention_heads} query heads a layer"
            )
        by_layer.setdefault(layer, []).append(head)
    return by_layer


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
    with modify(model, Window(check_int(window, "window", minimum=1))):
        yield


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
            raise InvalidValueError(
                "a boolean key mask must be [batch, seq] (True = hidden), got shape "
                f"{tuple(positions.shape)}; for a list of positions pass integers"
            )
        hidden = positions
    else:
        positions = check_integers(positions, "key positions").reshape(-1)
        if positions.numel() and int(positions.min()) < 0:
            raise OutOfRangeError(f"key positions must be non-negative, got {positions.tolist()}")
        hidden = torch.zeros(1, int(positions.max()) + 1 if positions.numel() else 0, dtype=torch.bool)
        hidden[0, positions] = True
    inner = hf_model(model)
    context = model_context(inner)
    if context is not None and hidden.shape[1] > context:
        raise OutOfRangeError(
            f"key positions up to {hidden.shape[1] - 1} exceed the model's context of {context}"
        )
    with modify(inner, KeyMask(hidden)):
        yield


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
        raise InvalidTypeError(f"positions must be an integer tensor, got {positions.dtype}")
    if positions.ndim == 1:
        positions = positions[None]
    if positions.ndim != 2 or not bool((positions.diff(dim=1) > 0).all()):
        raise InvalidValueError(
            "positions must be LongTensor[batch or 1, kv], strictly increasing along each row"
        )
    if any(POSITIONS in modifier.changes for modifier in active_modifiers()):
        raise InvalidValueError(
            "original_positions is already active: the positions of one forward are one map"
        )
    with modify(model, OriginalPositions(positions.long())):
        yield


@contextmanager
def bias_keys(model, bias: torch.Tensor, units: torch.Tensor | None = None) -> Iterator[None]:
    """Add ``bias[b, j]`` to the attention logit of key j from every later query (i > j), in every
    layer and head, inside the block.

    ``bias``: Tensor[batch or 1, seq] (or Tensor[seq]) over the tokens of one forward without a KV
    cache. At ``bias = 0`` the model is unchanged; ``bias → −∞`` removes key j from every later
    query, so with ``bias.requires_grad`` the gradient ∂f/∂bias_j is a first-order estimate of
    removing token j everywhere, indirect paths included (see
    :func:`probe.probes.key_removal.key_removal_gradient`). ``units``: LongTensor[seq], the removal unit of
    each token (e.g. the source it belongs to); a query then gets no bias on the keys of its own unit,
    since removing the unit removes that query too. Works with checkpointing, sliding windows,
    captures and the other modifiers (a trace sees the biased attention).
    """
    if not torch.is_tensor(bias) or not bias.is_floating_point():
        raise InvalidTypeError("bias must be a floating-point tensor [batch or 1, seq]")
    bias = bias[None] if bias.ndim == 1 else bias
    if bias.ndim != 2:
        raise InvalidValueError(f"bias must be Tensor[batch or 1, seq], got shape {tuple(bias.shape)}")
    if units is not None and (
        not torch.is_tensor(units) or units.dtype != torch.long or units.shape != bias.shape[-1:]
    ):
        raise InvalidValueError(f"units must be a LongTensor[{bias.shape[-1]}], one removal unit per token")
    with modify(model, KeyBias(bias, units)):
        yield


@contextmanager
def lrp_attention(model) -> Iterator[None]:
    """Inside the block the attention's backward follows AttnLRP's uniform rule (Achtibat et al. 2024,
    eq. 7): the gradients of queries and keys are divided by 4, those of values by 2; the forward is
    unchanged. Part of :func:`probe.probes.lrp.lrp_rules`."""
    with modify(model, Relevance()):
        yield
