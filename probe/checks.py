"""One validation layer for every probe, modifier, detector, metric and CLI: each argument checked
against the actual model and input before any model work, with the argument's name, what it got
and what to do in the message.

- ``TypeError``: the wrong kind (a fraction, a bool, a string where integers belong);
- ``IndexError``: out of range for this model or input;
- ``ValueError``: empty, repeated, or inconsistent with another argument;
- :class:`UnsupportedModelError`: a model whose attention longprobe cannot serve.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel


class UnsupportedModelError(TypeError):
    """A model whose attention the capture core cannot hook."""


def hf_model(model) -> PreTrainedModel:
    """``model`` checked to be a Hugging Face model whose attention longprobe can hook."""
    if type(model).__name__ == "TransformerBridge":
        raise UnsupportedModelError(
            "a transformer-lens TransformerBridge computes attention itself, outside transformers' "
            "AttentionInterface (and booting one rewires the HF model it wraps); pass longprobe the plain "
            "HF model and make the bridge from a copy with probe.to_bridge(model, tokenizer) - the "
            "cache names (blocks.{l}.attn.hook_pattern) are the same"
        )
    if not isinstance(model, PreTrainedModel):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a Hugging Face PreTrainedModel; longprobe hooks attention "
            "through transformers' AttentionInterface"
        )
    if not any(getattr(module, "is_causal", False) for module in model.modules()):
        raise _bidirectional(model)
    return model


def _bidirectional(module: torch.nn.Module) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{type(module).__name__} attends in both directions (an encoder such as BERT), and longprobe's "
        "probes read causal attention, where each token sees only the ones before it: use a decoder-only "
        "causal language model (AutoModelForCausalLM)"
    )


def input_device(model) -> torch.device:
    """Where ``model``'s inputs go: the execution device of accelerate's offload hooks
    (``cpu_offload``, ``disk_offload``, a ``device_map`` with offloading), else the device of the
    input embeddings (the first device of a model split over several), else the model's device."""
    inner = hf_model(model)
    embeddings = inner.get_input_embeddings()
    for module in (inner, embeddings):
        device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return torch.device(device)
    device = embeddings.weight.device
    return device if device.type != "meta" else inner.device


def n_layers(model) -> int:
    return hf_model(model).config.get_text_config().num_hidden_layers


def check_layers(model, layers: Sequence[int] | None) -> list[int]:
    """``layers`` (``None`` = all; negative indices allowed) as non-negative indices, range-checked."""
    total = n_layers(model)
    layers = list(range(total)) if layers is None else list(layers)
    if not layers:
        raise ValueError("layers is empty: pass None for all layers, or at least one layer index")
    check_integers(layers, "layers")
    bad = [layer for layer in layers if not -total <= layer < total]
    if bad:
        raise IndexError(f"layers {bad} out of range for a {total}-layer model")
    return [layer % total for layer in layers]


def check_input_ids(model, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``input_ids`` as a LongTensor[1, seq], checked against the model's context length."""
    check_integers(input_ids, "input_ids")
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [seq] or [1, seq], got {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty")
    context = getattr(hf_model(model).config.get_text_config(), "max_position_embeddings", None)
    if context is not None and ids.shape[1] > context:
        raise ValueError(
            f"sequence of {ids.shape[1]} tokens is longer than the model's context of {context} tokens; "
            "truncate the input or use a model with a longer context"
        )
    vocab = hf_model(model).get_input_embeddings().num_embeddings
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        bad = ids[(ids < 0) | (ids >= vocab)].unique()[:5].tolist()
        raise IndexError(
            f"token ids {bad} are outside the model's vocabulary of {vocab} ids: the tokenizer probably "
            "does not belong to this model; load both together (probe.load_model returns the pair)"
        )
    return ids.to(input_device(model))


def check_integers(values, what: str) -> None:
    """Refuse fractional values (``3.5`` would silently become ``3``)."""
    values = torch.as_tensor(values) if not isinstance(values, torch.Tensor) else values
    if values.is_floating_point() and not bool((values == values.round()).all()):
        raise TypeError(f"{what} must be integers, got {values.reshape(-1)[:8].tolist()}")


def check_positions(
    positions: Sequence[int] | torch.Tensor, seq: int, what: str, minimum: int = 0
) -> torch.Tensor:
    """Positions as a sorted-as-given LongTensor[k], each in ``[minimum, seq)``, no repeats."""
    check_integers(positions, what)
    pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    if pos.numel() == 0:
        raise ValueError(f"{what} is empty; give at least one position")
    bad = pos[(pos < minimum) | (pos >= seq)]
    if bad.numel():
        hint = " (position 0 has no preceding row to predict it)" if minimum == 1 and (bad == 0).any() else ""
        raise IndexError(
            f"{what} {bad.tolist()} out of range [{minimum}, {seq}) for a {seq}-token input{hint}"
        )
    if pos.unique().numel() != pos.numel():
        raise ValueError(f"{what} contains repeated positions: {pos.tolist()}")
    return pos
