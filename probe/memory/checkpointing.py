"""Activation checkpointing of decoder layers that keeps longprobe's modifiers in the recomputation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from probe.attention import active_modifiers, recomputation
from probe.checks import CACHE_KEYWORDS, UnsupportedModelError, hf_model
from probe.errors import InvalidTypeError, InvalidValueError


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
    if not isinstance(enabled, bool):
        raise InvalidTypeError(f"enabled must be True or False, got {enabled!r:.60}")
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
        if any(kwargs.get(name) is not None for name in CACHE_KEYWORDS):
            raise InvalidValueError(
                "checkpointing cannot write a KV cache; call the model with use_cache=False"
            )
        modifiers = active_modifiers()
        return checkpoint(
            forward,
            *args,
            use_reentrant=False,
            context_fn=lambda: (nullcontext(), recomputation(modifiers)),
            **kwargs,
        )

    checkpointed_forward.checkpointing = True
    return checkpointed_forward
