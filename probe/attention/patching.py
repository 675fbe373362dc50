"""Activation patching of attention heads, TransformerLens-style: record every head's output in one run
(:func:`record_heads`), then run another with chosen heads' outputs taken from it (:func:`patch_heads`).

A head's output is its ``A·V`` before the output projection, ``hook_z`` in TransformerLens:
Tensor[batch, seq, heads, head_dim] per layer. Patching the heads that carry a fact from a clean run
into a corrupted one, and watching the answer come back, is the causal test of a circuit (Wang et al.
2023, "Interpretability in the Wild"; Heimersheim & Nanda 2024, "How to use and interpret activation
patching"). Both are output modifiers of the one attention function (:mod:`probe.attention`), so they
nest with traces, masks, windows and checkpointing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from probe.attention import OUTPUTS, LayerCall, Modifier, modify, recomputing
from probe.attention.capture import HOOK_NAMES, ActivationCache
from probe.attention.modifiers import HeadModifier, check_heads
from probe.checks import check_layers, hf_model, n_layers
from probe.errors import InvalidTypeError, InvalidValueError, MissingKeyError

if TYPE_CHECKING:
    from probe.shapes import Shapes


@dataclass(eq=False)
class HeadRecord(Modifier):
    """Every head's output of ``layers``, stored in ``cache`` under ``blocks.{l}.attn.hook_z``."""

    changes = frozenset({OUTPUTS})
    stage = 2  # records the output as it goes to the output projection, after every change
    layers: frozenset[int]
    cache: ActivationCache

    def outputs(self, output: torch.Tensor, call: LayerCall) -> torch.Tensor:
        if call.layer in self.layers and not recomputing():
            self.cache[HOOK_NAMES["z"].format(layer=call.layer)] = output.detach()
        return output

    def reach(self, layer: int | None) -> None:
        if layer in self.layers:
            self.layers_seen.add(layer)

    def memory(
        self, shapes: Shapes, seq_len: int, batch: int, checkpoint: bool, alongside: Sequence[Modifier]
    ) -> dict[str, int]:
        """The recorded outputs: ``layers·n·H·h·a``."""
        size = batch * len(self.layers) * seq_len * shapes.heads * shapes.head_dim * shapes.act_bytes
        return {"recorded_heads": size}


@dataclass(eq=False)
class HeadPatch(HeadModifier):
    """The outputs of ``heads`` replaced by ``source``'s."""

    source: ActivationCache

    def outputs(self, output: torch.Tensor, call: LayerCall) -> torch.Tensor:
        heads = self.heads.get(call.layer)
        if not heads:
            return output
        source = self.source["z", call.layer]
        if source.shape[1:] != output.shape[1:] or source.shape[0] not in (1, output.shape[0]):
            raise InvalidValueError(
                f"patch_heads: layer {call.layer}'s recorded head outputs have shape {tuple(source.shape)}, "
                f"this forward's {tuple(output.shape)} [batch, seq, heads, head_dim]: patch a forward over "
                "the same number of tokens as the recorded run, without a KV cache"
            )
        index = torch.tensor(heads, device=output.device)
        patched = source.to(output.device, output.dtype).index_select(2, index.to(source.device))
        return output.index_copy(2, index, patched.expand(output.shape[0], -1, -1, -1))


@contextmanager
def record_heads(model, layers: Sequence[int] | None = None) -> Iterator[ActivationCache]:
    """Record every head's output (``hook_z``, Tensor[batch, seq, heads, head_dim]) of ``layers``
    (``None`` = all) in the forwards inside the block; yields the :class:`ActivationCache`
    (``cache["z", layer]``). A later forward of the block overwrites an earlier one's."""
    inner = hf_model(model)
    record = HeadRecord(frozenset(check_layers(inner, layers)), ActivationCache(n_layers(inner)))
    with modify(inner, record):
        yield record.cache


@contextmanager
def patch_heads(model, source_cache: ActivationCache, heads: Iterable[tuple[int, int]]) -> Iterator[None]:
    """Replace the output of the given ``(layer, query head)`` pairs by their output in the recorded run
    ``source_cache`` (from :func:`record_heads`), in every forward inside the block.

    Every position of the head is patched; the forward must cover as many tokens as the recorded one
    (a recorded batch of 1 is used for every sequence of a batch). The rest of the model runs on the
    block's own input, so the change in the output measures what those heads carry.
    """
    inner = hf_model(model)
    by_layer = check_heads(inner, heads)
    if not isinstance(source_cache, ActivationCache):
        raise InvalidTypeError(
            "source_cache must be the ActivationCache of probe.record_heads(model), "
            f"got {type(source_cache).__name__}"
        )
    missing = [layer for layer in by_layer if HOOK_NAMES["z"].format(layer=layer) not in source_cache]
    if missing:
        raise MissingKeyError(
            f"source_cache holds no head outputs of layers {missing}: record the source run inside "
            "probe.record_heads(model) (with those layers)"
        )
    with modify(inner, HeadPatch(by_layer, source_cache)):
        yield
