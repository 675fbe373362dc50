"""RoPE base changes: a model variant whose rotary position embedding turns at other frequencies.

RoPE rotates channel pair i of the queries and keys at position m by the angle m·θ_i, with
θ_i = base^(−2i/d) (the rotary embedding's ``inv_freq``, d the head dimension). Long-context
training raises the base (Fang et al. 2025, App. A.2: EABF's 500k; App. B.5: 500k → 2M to reach
beyond 32K); shrinking it turns every pair faster than the model was trained for, most of all the slow pairs
that carry long distances, and so hurts long-context retrieval more than local prediction.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from probe.checks import UnsupportedModelError, check_number, hf_model
from probe.errors import InvalidValueError

__all__ = ["rope_base"]

_MISSING = object()


@contextmanager
def rope_base(model, factor: float, layer_types: Sequence[str] = ("full_attention",)) -> Iterator[None]:
    """Multiply the RoPE base of ``model`` by ``factor`` inside the block: θ_i = (factor·base)^(−2i/d).

    The model then equals the one built from a config whose ``rope_theta`` is ``factor`` times larger,
    with the same weights: the config's ``rope_parameters`` are changed and ``inv_freq`` is recomputed by
    the rotary embedding's own init function (RoPE scaling types keep their scaling).

    A model with one rotary embedding (Llama, SmolLM2, Qwen) changes it for every layer. A model with
    one per attention type (Gemma 3: ``sliding_attention`` base 10k, ``full_attention`` base 1M)
    changes those in ``layer_types``; the default is the global layers only. They alone attend beyond
    the local window (512 tokens in Gemma 3), and theirs is the base Gemma 3's long-context training
    raised (10k → 1M) while the local base stayed. Pass both types to scale both.

    On exit, also after an exception, the config and the embeddings' frequencies are restored (the
    same objects). ``factor=1``: unchanged. Nests with itself and with the attention modifiers.
    """
    factor = check_number(factor, "factor (of the RoPE base)", 0, open_below=True)
    if factor == 1:
        yield
        return
    inner = hf_model(model)
    embeddings = [m for m in inner.modules() if callable(getattr(m, "compute_default_rope_parameters", None))]
    if not embeddings:
        raise UnsupportedModelError(f"{type(inner).__name__} has no transformers rotary embedding to change")
    for module in embeddings:
        unknown = set(layer_types) - set(module.rope_type) if isinstance(module.rope_type, dict) else set()
        if unknown:
            raise InvalidValueError(
                f"unknown layer types {sorted(unknown)}; the model has {sorted(module.rope_type)}"
            )
    configs = list({id(module.config): module.config for module in embeddings}.values())
    saved_parameters = [(config, config.rope_parameters) for config in configs]
    saved_state = [
        (module, {name: getattr(module, name, _MISSING) for name in _state(module)}) for module in embeddings
    ]
    try:
        for config in configs:
            config.rope_parameters = _scaled(config.rope_parameters, factor, layer_types)
        for module in embeddings:
            _recompute(module, layer_types)
        yield
    finally:
        for config, parameters in saved_parameters:
            config.rope_parameters = parameters
        for module, state in saved_state:
            for name, value in state.items():
                if value is _MISSING:
                    vars(module).pop(name, None)
                else:
                    setattr(module, name, value)


def _types(module, layer_types: Sequence[str] | None = None) -> list[str | None]:
    """The embedding's attention types in ``layer_types`` (``None``: all); ``[None]`` for a single one."""
    if isinstance(module.rope_type, dict):
        return [t for t in module.rope_type if layer_types is None or t in layer_types]
    return [None]


def _state(module) -> list[str]:
    """Names of the attributes a RoPE change touches (``long_inv_freq``: longrope's cache)."""
    prefixes = ["" if t is None else f"{t}_" for t in _types(module)]
    names = ("inv_freq", "original_inv_freq", "attention_scaling", "long_inv_freq")
    return ["max_seq_len_cached"] + [prefix + name for prefix in prefixes for name in names]


def _scaled(parameters: dict, factor: float, layer_types: Sequence[str]) -> dict:
    """``rope_parameters`` with ``rope_theta`` times ``factor`` (per type: the types in ``layer_types``)."""
    if "rope_theta" in parameters:
        return {**parameters, "rope_theta": parameters["rope_theta"] * factor}
    return {t: _scaled(p, factor, ()) if t in layer_types else p for t, p in parameters.items()}


def _recompute(module, layer_types: Sequence[str]) -> None:
    """New ``inv_freq`` (and attention scaling) of the embedding's changed types, from its config."""
    for layer_type in _types(module, layer_types):
        prefix, kwargs = ("", {}) if layer_type is None else (f"{layer_type}_", {"layer_type": layer_type})
        rope_type = module.rope_type if layer_type is None else module.rope_type[layer_type]
        init = (
            module.compute_default_rope_parameters
            if rope_type == "default"
            else ROPE_INIT_FUNCTIONS[rope_type]
        )
        old: torch.Tensor = getattr(module, f"{prefix}inv_freq")
        inv_freq, scaling = init(module.config, **kwargs)
        inv_freq = inv_freq.to(device=old.device, dtype=old.dtype)
        setattr(module, f"{prefix}inv_freq", inv_freq)
        setattr(module, f"{prefix}original_inv_freq", inv_freq.clone())
        setattr(module, f"{prefix}attention_scaling", scaling)
        vars(module).pop(f"{prefix}long_inv_freq", None)  # longrope recomputes it from the changed config
