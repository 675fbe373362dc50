"""One validation layer for every probe, modifier, detector, metric and CLI: each argument checked
against the actual model and input before any model work, with the argument's name, what it got
and what to do in the message.

The contract (:mod:`probe.errors`): every public function of ``probe`` returns a correct result or
raises a :class:`~probe.errors.LongprobeError` naming the argument, what it got and what to do, before
any model work; no raw error from torch, numpy, pandas, transformers or Python reaches the user but
``KeyboardInterrupt`` and a genuine out-of-memory. ``tests/test_error_contract.py`` fuzzes it.

- :class:`~probe.errors.InvalidTypeError`: the wrong kind (a fraction, a bool, a string where
  integers belong, a tensor where a ``Sample`` belongs);
- :class:`~probe.errors.OutOfRangeError`: out of range for this model or input;
- :class:`~probe.errors.InvalidValueError`: empty, repeated, or inconsistent with another argument;
- :class:`~probe.errors.UnsupportedModelError`: a model whose attention longprobe cannot serve.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from probe.errors import InvalidTypeError, InvalidValueError, OutOfRangeError, UnsupportedModelError


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


CACHE_KEYWORDS = ("cache", "past_key_values")


def cache_keyword(model) -> str:
    """The keyword under which ``model``'s forward takes and returns its KV cache: ``cache`` from
    transformers 5.24 on, ``past_key_values`` before (and in models that still use it)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_KEYWORDS if name in parameters), CACHE_KEYWORDS[1])


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
    """The number of decoder layers of ``model`` (of its text model, for a multimodal one)."""
    return hf_model(model).config.get_text_config().num_hidden_layers


def model_context(model) -> int | None:
    """The number of positions ``model`` was trained for (``max_position_embeddings`` of its text
    model), or None where its config does not say."""
    return getattr(hf_model(model).config.get_text_config(), "max_position_embeddings", None)


def check_layers(model, layers: Sequence[int] | None) -> list[int]:
    """``layers`` (``None`` = all; negative indices allowed) as non-negative indices, range-checked."""
    total = n_layers(model)
    layers = list(range(total)) if layers is None else check_integers(layers, "layers").reshape(-1).tolist()
    if not layers:
        raise InvalidValueError("layers is empty: pass None for all layers, or at least one layer index")
    bad = [layer for layer in layers if not -total <= layer < total]
    if bad:
        raise OutOfRangeError(f"layers {bad} out of range for a {total}-layer model")
    return [layer % total for layer in layers]


def check_input_ids(model, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``input_ids`` as a LongTensor[1, seq], checked against the model's context length."""
    ids = check_integers(input_ids, "input_ids")
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise InvalidValueError(f"input_ids must have shape [seq] or [1, seq], got {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise InvalidValueError("input_ids is empty")
    context = model_context(model)
    if context is not None and ids.shape[1] > context:
        raise InvalidValueError(
            f"sequence of {ids.shape[1]} tokens is longer than the model's context of {context} tokens; "
            "truncate the input or use a model with a longer context"
        )
    vocab = hf_model(model).get_input_embeddings().num_embeddings
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        bad = ids[(ids < 0) | (ids >= vocab)].unique()[:5].tolist()
        raise OutOfRangeError(
            f"token ids {bad} are outside the model's vocabulary of {vocab} ids: the tokenizer probably "
            "does not belong to this model; load both together (probe.load_model returns the pair)"
        )
    return ids.to(input_device(model))


def check_integers(values, what: str) -> torch.Tensor:
    """``values`` (a list, a tensor) as a LongTensor, refusing what would silently change meaning: a
    bare number or string, booleans (``True`` would act as position 1) and floats (``2.5`` as 2)."""
    if isinstance(values, (str, bytes, int, float, dict, set)) or values is None:
        hint = f": pass [{values}]" if isinstance(values, int) and not isinstance(values, bool) else ""
        raise InvalidTypeError(f"{what} must be a list or tensor of integers, got {values!r}{hint}")
    if not torch.is_tensor(values) and any(isinstance(v, (bool, np.bool_)) for v in _flat(values)):
        raise InvalidTypeError(f"{what} must be integers, got booleans {list(values)[:8]}")
    try:
        tensor = values if torch.is_tensor(values) else torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InvalidTypeError(f"{what} must be a list or tensor of integers, got {values!r}") from error
    if tensor.dtype == torch.bool:
        raise InvalidTypeError(
            f"{what} must be integer positions, got a boolean tensor: pass mask.nonzero().flatten() "
            "for the positions where a mask is True"
        )
    if (tensor.is_floating_point() or tensor.is_complex()) and tensor.numel():  # [] reads as float
        raise InvalidTypeError(
            f"{what} must be integers, got {tensor.dtype} values {tensor.reshape(-1)[:8].tolist()}"
        )
    return tensor.long()


def _flat(values) -> list:
    """The leaves of nested lists / tuples (arrays and tensors stay whole)."""
    if isinstance(values, (list, tuple)):
        return [leaf for value in values for leaf in _flat(value)]
    return [values]


def check_int(value, what: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int: an integer (not a bool, a float or a string) in ``[minimum, maximum]``."""
    integral = isinstance(value, (int, np.integer)) or (
        torch.is_tensor(value) and value.ndim == 0 and not value.is_floating_point()
    )
    if (
        isinstance(value, (bool, np.bool_))
        or (torch.is_tensor(value) and value.dtype == torch.bool)
        or not integral
    ):
        raise InvalidTypeError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "" if minimum is None else f"at least {minimum}"
        high = "" if maximum is None else f"at most {maximum}"
        raise InvalidValueError(f"{what} must be {' and '.join(b for b in (low, high) if b)}, got {value}")
    return value


def check_number(
    value, what: str, minimum: float | None = None, maximum: float | None = None, open_below: bool = False
) -> float:
    """``value`` as a finite float (an int or float, not a bool or a string) in ``[minimum, maximum]``
    (``(minimum, maximum]`` with ``open_below``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidTypeError(f"{what} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not np.isfinite(value):
        raise InvalidValueError(f"{what} must be a finite number, got {value}")
    below = value <= minimum if open_below else value < minimum if minimum is not None else False
    if below or (maximum is not None and value > maximum):
        low = "" if minimum is None else f"{'above' if open_below else 'at least'} {minimum}"
        high = "" if maximum is None else f"at most {maximum}"
        raise InvalidValueError(f"{what} must be {' and '.join(b for b in (low, high) if b)}, got {value}")
    return value


def check_text(value, what: str) -> str:
    """``value``: non-empty text."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidValueError(f"{what} must be non-empty text, got {value!r}")
    return value


def check_tokenizer(tokenizer, optional: bool = False) -> PreTrainedTokenizerBase | None:
    """``tokenizer``: a Hugging Face tokenizer (``probe.load_model`` returns the model's own), or
    ``None`` where ``optional``."""
    if tokenizer is None and optional:
        return None
    # a tokenizer of another library: called on text, maps ids back
    duck = callable(tokenizer) and any(hasattr(tokenizer, a) for a in ("decode", "convert_ids_to_tokens"))
    if not isinstance(tokenizer, PreTrainedTokenizerBase) and not duck:
        raise InvalidTypeError(
            f"tokenizer must be a Hugging Face tokenizer, got {type(tokenizer).__name__}: pass the one "
            "probe.load_model returned with the model (or AutoTokenizer.from_pretrained(...))"
        )
    return tokenizer


def check_option(value, annotation: str, what: str) -> None:
    """An option checked by its annotation (``int``, ``float``, ``bool``, ``str`` and ``... | None``);
    ints at least 0 (1 for counts named in :data:`COUNTS`), floats finite."""
    kinds = {part.strip() for part in annotation.split("|")}
    if value is None and "None" in kinds:
        return
    if kinds <= {"int", "None"}:
        check_int(value, what, 1 if what.rsplit(" ", 1)[-1] in COUNTS else 0)
    elif kinds <= {"float", "None"}:
        check_number(value, what)
    elif kinds <= {"bool", "None"} and not isinstance(value, (bool, np.bool_)):
        raise InvalidTypeError(f"{what} must be True or False, got {value!r}")
    elif kinds <= {"str", "None"} and not isinstance(value, str):
        raise InvalidTypeError(f"{what} must be text, got {value!r}")


#: Integer options that count something and must be at least 1.
COUNTS = ("top_k", "top_m", "K", "d", "block", "n_masks", "internal_batch_size", "steps", "batch_size")


def check_token_flags(flags, seq: int, what: str) -> torch.Tensor:
    """``flags`` (a bool tensor or a list of bools) as a BoolTensor[seq] on the CPU, one flag per token;
    integers are refused (``1`` would not read as a position here, nor a position as a flag)."""
    flags = torch.as_tensor(flags).cpu()
    if flags.dtype != torch.bool or flags.shape != (seq,):
        raise InvalidValueError(
            f"{what} must be a BoolTensor[{seq}], one flag per token, got {flags.dtype} {tuple(flags.shape)}"
        )
    return flags


def check_positions(
    positions: Sequence[int] | torch.Tensor, seq: int, what: str, minimum: int = 0
) -> torch.Tensor:
    """Positions as a sorted-as-given LongTensor[k], each in ``[minimum, seq)``, no repeats."""
    pos = check_integers(positions, what).reshape(-1)
    if pos.numel() == 0:
        raise InvalidValueError(f"{what} is empty; give at least one position")
    bad = pos[(pos < minimum) | (pos >= seq)]
    if bad.numel():
        hint = " (position 0 has no preceding row to predict it)" if minimum == 1 and (bad == 0).any() else ""
        raise OutOfRangeError(
            f"{what} {bad.tolist()} out of range [{minimum}, {seq}) for a {seq}-token input{hint}"
        )
    if pos.unique().numel() != pos.numel():
        raise InvalidValueError(f"{what} contains repeated positions: {pos.tolist()}")
    return pos


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer → fingerprint


def tokenizer_fingerprint(tokenizer) -> dict:
    """``{"name", "vocab_size", "vocab_hash"}`` of a tokenizer: what a sample records of the tokenizer
    that made it (the hash: SHA-1 of its sorted vocabulary; computed once per tokenizer object)."""
    if tokenizer in _FINGERPRINTS:
        return _FINGERPRINTS[tokenizer]
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    found = {
        "name": getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "vocab_hash": hashlib.sha1(vocab.encode()).hexdigest()[:16],
    }
    _FINGERPRINTS[tokenizer] = found
    return found


def check_sample_fits(model, sample, tokenizer=None) -> None:
    """Refuse a sample made by another tokenizer than ``tokenizer`` (its recorded fingerprint), or
    than ``model``'s vocabulary can be (ids of one vocabulary are other words in another: a model
    with a larger vocabulary would read them without an error). Samples built by hand carry no
    fingerprint and pass."""
    made = getattr(sample, "tokenizer", None)
    if not made:
        return
    fix = "make the sample with this model's own tokenizer (probe.load_model returns the pair)"
    if tokenizer is not None and tokenizer_fingerprint(tokenizer)["vocab_hash"] != made["vocab_hash"]:
        raise InvalidValueError(
            f"the sample was tokenized by {made['name']} ({made['vocab_size']} tokens), not by the tokenizer "
            f"given ({tokenizer_fingerprint(tokenizer)['name']}): {fix}"
        )
    if model is None:  # a detector that reads no model (lexical_overlap, recency)
        return
    rows = hf_model(model).get_input_embeddings().num_embeddings
    if abs(rows - made["vocab_size"]) > max(1024, 0.02 * made["vocab_size"]):
        raise InvalidValueError(
            f"the sample was tokenized by {made['name']} ({made['vocab_size']} tokens), but the model has "
            f"{rows} token embeddings: {fix}"
        )
