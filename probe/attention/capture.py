"""Capture attention rows and their gradients: :func:`trace` and the :class:`ActivationCache` it fills.

:func:`trace` is an output modifier of the one attention function (:mod:`probe.attention`): it
captures ``A[rows] = softmax(q_rows·Kᵀ·scale + mask)`` from the post-RoPE queries and keys the layer was
given (GQA: per query head), with the model's own mask and every active modifier's change; with
``grad=True`` it replaces those rows of the output by ``A[rows]·V`` so autograd yields ∂L/∂A[rows]
exactly. Memory is O(layers·heads·rows·seq), not O(layers·heads·seq²). Tensors land in an
:class:`ActivationCache` under TransformerLens's names (``blocks.{l}.attn.hook_pattern``,
``…hook_pattern_grad``; :func:`probe.attention.patching.record_heads` adds ``…hook_z``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from probe.attention import OUTPUTS, LayerCall, Modifier, active_modifiers, modify, not_reached, recomputing
from probe.attention.patterns import apply_pattern, pattern_blocks
from probe.checks import check_int, check_integers, check_layers, hf_model, n_layers
from probe.errors import InvalidValueError, MissingKeyError, OutOfRangeError

HOOK_NAMES = {
    "pattern": "blocks.{layer}.attn.hook_pattern",
    "pattern_grad": "blocks.{layer}.attn.hook_pattern_grad",
    "z": "blocks.{layer}.attn.hook_z",
}


class ActivationCache(dict):
    """Captured tensors by TransformerLens hook name: patterns ``[batch, heads, rows, keys]``, head
    outputs ``[batch, seq, heads, head_dim]``.

    Index by full name (``cache["blocks.3.attn.hook_pattern"]``) or by ``(kind, layer)``
    (``cache["pattern", 3]``, ``cache["pattern_grad", -1]``, ``cache["z", 0]``).
    """

    def __init__(self, n_layers: int):
        super().__init__()
        self.n_layers = n_layers

    def __getitem__(self, key):
        if isinstance(key, tuple):
            kind, layer = key
            if kind not in HOOK_NAMES:
                raise MissingKeyError(f"unknown kind {kind!r}: one of {sorted(HOOK_NAMES)}")
            key = HOOK_NAMES[kind].format(layer=layer % self.n_layers)
        if key not in self:
            held = ", ".join(sorted(self, key=lambda name: (len(name), name))) or "nothing"
            hint = " (gradients need trace(..., grad=True) and a backward)" if key.endswith("_grad") else ""
            raise MissingKeyError(f"{key} was not captured{hint}; the cache holds: {held}")
        return super().__getitem__(key)

    def stack(self, kind: str = "pattern", layers: Sequence[int] | None = None) -> torch.Tensor:
        """Tensor[layers, heads, rows, keys] of batch element 0, in ``layers`` order."""
        layers = range(self.n_layers) if layers is None else layers
        return torch.stack([self[kind, layer][0] for layer in layers])


@dataclass(eq=False)
class Capture(Modifier):
    """What one active trace captures (see :func:`trace`)."""

    changes = frozenset({OUTPUTS})
    stage = 0  # rebuilds its rows as A·V before any modifier changes or records the output
    layers: frozenset[int]
    rows: torch.Tensor | None  # query rows to capture; None = all rows
    grad: bool
    block_size: int
    on_pattern: Callable[[int, torch.Tensor], None] | None
    cache: ActivationCache

    def outputs(self, output: torch.Tensor, call: LayerCall) -> torch.Tensor:
        """Capture this layer's rows; ``output`` [batch, q, heads, dim], its rows replaced by A·V if grad.

        When a checkpointed layer is recomputed in the backward pass, the same tensors are computed
        again (autograd needs them) but nothing is recorded a second time.
        """
        layer, query = call.layer, call.query
        if layer not in self.layers:
            return output
        if call.dropout > 0:
            raise InvalidValueError(
                "attention dropout is active: call model.eval() before capturing attention"
            )
        again = recomputing()
        q_len = query.shape[2]
        rows = torch.arange(q_len, device=query.device) if self.rows is None else self.rows.to(query.device)
        if int(rows.max()) >= q_len:
            raise OutOfRangeError(f"captured rows {rows.tolist()} out of range for {q_len} query positions")
        grad = self.grad and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):
            pattern = pattern_blocks(query, call.key, rows, call.attention_mask, call.logits, self.block_size)
        if grad:
            if not pattern.requires_grad:  # nothing upstream needs gradients: A itself is the leaf
                pattern.requires_grad_(True)
            if not again:
                name = HOOK_NAMES["pattern_grad"].format(layer=layer)
                pattern.register_hook(lambda g: self.cache.__setitem__(name, g))
            output = output.index_copy(1, rows, apply_pattern(pattern, call.value).to(output.dtype))
        if again:
            return output
        if self.on_pattern is not None:
            self.on_pattern(layer, pattern.detach())
        else:
            self.cache[HOOK_NAMES["pattern"].format(layer=layer)] = pattern.detach()
        return output

    def reach(self, layer: int | None) -> None:
        if layer in self.layers and not recomputing():
            self.layers_seen.add(layer)

    def finish(self, inner) -> None:
        if self.layers and not self.layers_seen:
            raise not_reached(inner)


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
    chosen = frozenset(check_layers(inner, layers))
    check_int(block_size, "block_size", minimum=1)
    if rows is not None:
        rows = check_integers(rows, "rows").reshape(-1)
        if rows.numel() == 0 or int(rows.min()) < 0:
            raise OutOfRangeError(
                f"rows must be non-empty, non-negative query positions, got {rows.tolist()}"
            )
    if grad and any(isinstance(m, Capture) and m.grad and m.layers & chosen for m in active_modifiers()):
        raise InvalidValueError(
            "two traces with grad=True capture the same layer; use one trace with all rows"
        )
    capture = Capture(chosen, rows, grad, block_size, on_pattern, ActivationCache(n_layers(inner)))
    with modify(inner, capture):
        yield capture.cache
