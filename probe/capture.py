"""The capture core: one context manager through which every probe reads attention.

Inside ``trace(model, rows=..., layers=...)`` the model's attention runs through our own
function, registered with transformers' ``AttentionInterface`` under the name ``"longprobe"``:

1. the layer output is computed by the fused ``sdpa`` kernel, exactly as without the trace;
2. for the captured query rows it recomputes ``A[rows] = softmax(q_rows·Kᵀ·scale + mask)``
   from the post-RoPE queries and keys the layer was given (GQA: per query head), with the
   model's own causal / sliding-window mask;
3. with ``grad=True`` it replaces those rows of the output by ``A[rows]·V``, so autograd
   yields ∂L/∂A[rows] exactly, while everything else keeps the fused kernel.

Memory is O(layers·heads·rows·seq), not O(layers·heads·seq²). Tensors land in an
:class:`ActivationCache` under TransformerLens's names (``blocks.{l}.attn.hook_pattern``,
``…hook_pattern_grad``). On exit — also after an exception — the model's attention
implementation, parameter flags and train/eval mode are restored.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

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
            key = HOOK_NAMES[kind].format(layer=layer % self.n_layers)
        return super().__getitem__(key)

    def stack(self, kind: str = "pattern", layers: Sequence[int] | None = None) -> torch.Tensor:
        """Tensor[layers, heads, rows, keys] of batch element 0, in ``layers`` order."""
        layers = range(self.n_layers) if layers is None else layers
        return torch.stack([self[kind, layer][0] for layer in layers])


@dataclass
class _Capture:
    """What one active trace captures, and what it has seen."""

    layers: frozenset[int]
    rows: torch.Tensor | None  # query rows to capture; None = all rows
    grad: bool
    block_size: int
    on_pattern: Callable[[int, torch.Tensor], None] | None
    cache: ActivationCache
    layers_seen: set[int] = field(default_factory=set)


_ACTIVE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("longprobe_capture", default=None)


@dataclass
class _Ablation:
    """Query heads whose output is zeroed, by layer, and the layers that were reached."""

    heads: dict[int, list[int]]
    layers_seen: set[int] = field(default_factory=set)


_ABLATED: contextvars.ContextVar[_Ablation | None] = contextvars.ContextVar("longprobe_ablate", default=None)


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
    return model


def n_layers(model) -> int:
    return hf_model(model).config.get_text_config().num_hidden_layers


def check_layers(model, layers: Sequence[int] | None) -> list[int]:
    """``layers`` (``None`` = all; negative indices allowed) as non-negative indices, range-checked."""
    total = n_layers(model)
    layers = list(range(total)) if layers is None else list(layers)
    bad = [layer for layer in layers if not -total <= layer < total]
    if bad:
        raise IndexError(f"layers {bad} out of range for a {total}-layer model")
    return [layer % total for layer in layers]


def check_input_ids(model, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``input_ids`` as a LongTensor[1, seq], checked against the model's context length."""
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
    return ids.to(hf_model(model).device)


def check_positions(
    positions: Sequence[int] | torch.Tensor, seq: int, what: str, minimum: int = 0
) -> torch.Tensor:
    """Positions as a sorted-as-given LongTensor[k], each in ``[minimum, seq)``, no repeats."""
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


def _mask_rows(
    attention_mask: torch.Tensor | None,
    rows: torch.Tensor,
    q_len: int,
    kv_len: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive mask [batch or 1, 1, rows, kv] for the captured rows.

    transformers passes a boolean (True = attend) or additive mask, or ``None`` when sdpa's
    own causal flag suffices; then queries are aligned to the end of the keys (as under a
    KV cache) and a sliding window, if any, keeps the last ``sliding_window`` keys.
    """
    if attention_mask is not None:
        mask = attention_mask[:, :, rows, :kv_len]
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
        return mask.to(dtype)
    query_pos = (kv_len - q_len + rows)[:, None]
    key_pos = torch.arange(kv_len, device=rows.device)[None]
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
) -> torch.Tensor:
    """A[rows] = softmax(q_rows·Kᵀ·scale + mask): Tensor[batch, heads, rows, kv].

    ``query`` is [batch, heads, q, dim], ``key`` [batch, kv_heads, kv, dim]; query head h reads
    KV head h // (heads / kv_heads), as transformers' ``repeat_kv`` does, without copying K.
    """
    batch, heads, _, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    grouped = query[:, :, rows].reshape(batch, kv_heads, heads // kv_heads * len(rows), dim)
    scores = (grouped @ key.transpose(-1, -2)).view(batch, heads, len(rows), kv_len) * scaling
    return torch.softmax((scores + mask).float(), dim=-1).to(query.dtype)


def _capture_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"longprobe"`` (see the module docstring)."""
    output, _ = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    layer = getattr(module, "layer_idx", None)
    output = _ablate(output, layer)
    capture = _ACTIVE.get()
    if capture is None or layer is None or layer not in capture.layers:
        return output, None
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__} uses attention logit soft-capping or sink logits, which the "
            "capture core does not model; capture is exact only for plain softmax attention"
        )
    if dropout > 0:
        raise ValueError("attention dropout is active: call model.eval() before capturing attention")
    capture.layers_seen.add(layer)
    q_len, kv_len = query.shape[2], key.shape[2]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    rows = torch.arange(q_len, device=query.device) if capture.rows is None else capture.rows.to(query.device)
    if int(rows.max()) >= q_len:
        raise IndexError(f"captured rows {rows.tolist()} out of range for {q_len} query positions")

    blocks = []
    for block in rows.split(capture.block_size):
        mask = _mask_rows(attention_mask, block, q_len, kv_len, kwargs.get("sliding_window"), query.dtype)
        with torch.set_grad_enabled(capture.grad and torch.is_grad_enabled()):
            blocks.append(pattern_rows(query, key, block, mask, scaling))
    pattern = torch.cat(blocks, dim=2) if len(blocks) > 1 else blocks[0]

    if capture.grad and torch.is_grad_enabled():
        if not pattern.requires_grad:  # nothing upstream needs gradients: A itself is the leaf
            pattern.requires_grad_(True)
        name = HOOK_NAMES["pattern_grad"].format(layer=layer)
        pattern.register_hook(lambda grad: capture.cache.__setitem__(name, grad))
        batch, heads, n_rows, _ = pattern.shape
        kv_heads = key.shape[1]
        grouped = pattern.reshape(batch, kv_heads, heads // kv_heads * n_rows, kv_len)
        row_output = (grouped @ value).view(batch, heads, n_rows, -1).transpose(1, 2)
        output = _ablate(output.index_copy(1, rows, row_output.to(output.dtype)), layer)

    if capture.on_pattern is not None:
        capture.on_pattern(layer, pattern.detach())
    else:
        capture.cache[HOOK_NAMES["pattern"].format(layer=layer)] = pattern.detach()
    return output, None


def _ablate(output: torch.Tensor, layer: int | None) -> torch.Tensor:
    """``output`` [batch, q, heads, dim] with the heads ablated in ``layer`` set to zero."""
    ablation = _ABLATED.get()
    if ablation is None or layer not in ablation.heads:
        return output
    ablation.layers_seen.add(layer)
    keep = torch.ones(output.shape[2], dtype=output.dtype, device=output.device)
    keep[ablation.heads[layer]] = 0
    return output * keep[:, None]


AttentionInterface.register(IMPLEMENTATION, _capture_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


@contextmanager
def frozen_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Turn off parameter gradients (and dropout) for the block; restore both afterwards."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    try:
        model.requires_grad_(False)
        model.eval()
        yield
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)
        model.train(was_training)


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
        model: a Hugging Face causal LM (or a TransformerBridge wrapping one).
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
    if rows is not None:
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
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
    token = _ACTIVE.set(capture)
    try:
        with _routed(inner):
            yield capture.cache
    finally:
        _ACTIVE.reset(token)
    if capture.layers and not capture.layers_seen:
        raise _not_reached(inner)


@contextmanager
def ablate_heads(model, heads: Iterable[tuple[int, int]]) -> Iterator[None]:
    """Zero the output of the given ``(layer, query head)`` pairs in every forward inside the block.

    The head's contribution to the residual stream (its slice of the input to the output
    projection) is removed, the usual "mask a head" ablation (Wu et al. 2024 instead make the
    head's attention uniform). Works with ``model.generate`` and inside :func:`trace`; the
    model's attention implementation is restored on exit, also after an exception.
    """
    inner = hf_model(model)
    config = inner.config.get_text_config()
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        (layer,) = check_layers(inner, [layer])
        if not 0 <= head < config.num_attention_heads:
            raise IndexError(f"head {head} out of range for {config.num_attention_heads} query heads a layer")
        by_layer.setdefault(layer, []).append(head)
    ablation = _Ablation(by_layer)
    token = _ABLATED.set(ablation)
    try:
        with _routed(inner):
            yield
    finally:
        _ABLATED.reset(token)
    if by_layer and not ablation.layers_seen:
        raise _not_reached(inner)


@contextmanager
def _routed(inner: PreTrainedModel) -> Iterator[None]:
    """Route ``inner``'s attention through longprobe's function for the block; restore it after."""
    if not inner._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(inner).__name__} does not route attention through transformers' AttentionInterface, "
            "so longprobe cannot hook it; use an architecture written in the functional attention style "
            "(Llama, Gemma 3, Qwen, Mistral, ...)"
        )
    original = inner.config._attn_implementation
    try:
        inner.set_attn_implementation(IMPLEMENTATION)
        yield
    finally:
        inner.set_attn_implementation(original)


def _not_reached(inner: PreTrainedModel) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"no attention call of {type(inner).__name__} reached longprobe's attention function "
        "(did the block run a forward pass?); the model's attention may not use the AttentionInterface"
    )


def target_loss(
    model, input_ids: torch.Tensor, target_positions: torch.Tensor, **forward_kwargs
) -> torch.Tensor:
    """Mean cross-entropy of the tokens at ``target_positions``, predicted from rows ``t − 1``.

    Only the needed rows are projected to the vocabulary (``logits_to_keep``), never the
    full ``[seq, vocab]`` logits. ``forward_kwargs`` may pass ``inputs_embeds`` instead of ids.
    """
    inner = hf_model(model)
    if "inputs_embeds" not in forward_kwargs:
        forward_kwargs["input_ids"] = input_ids
    logits = inner(use_cache=False, logits_to_keep=target_positions - 1, **forward_kwargs).logits
    logits = logits[0].to(torch.promote_types(logits.dtype, torch.float32))  # upcast half, keep double
    return torch.nn.functional.cross_entropy(logits, input_ids[0, target_positions])
