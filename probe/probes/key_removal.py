"""The key-removal gradient: a first-order estimate, from one forward and backward, of what removing a
context token everywhere (every later query of every layer and head) does to the answer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from probe.attention.modifiers import bias_keys, mask_keys
from probe.attention.shared_state import frozen_parameters
from probe.checks import check_input_ids, check_int, check_positions, check_token_flags, hf_model
from probe.errors import InvalidValueError
from probe.faithfulness.compaction import check_before_answer, compacted, compaction_supported
from probe.memory.planner import guarded
from probe.target import Target, target_of


def key_removal_gradient(
    model,
    input_ids: torch.Tensor | Sequence[int],
    target_positions: Sequence[int],
    checkpoint: bool | str = "auto",
    depth: float = 0.0,
    steps: int = 1,
    target: Target | None = None,
    sources: Sequence[tuple[int, int]] | None = None,
    kept: torch.Tensor | None = None,
    presence: float = 1.0,
) -> torch.Tensor:
    """∂ log P(answer) / ∂b_j at b = 0 (``target``: of another number about the answer, see
    :mod:`probe.target`), where b_j is added to the attention logit of key j from every
    later query, in every layer and head (:func:`probe.attention.modifiers.bias_keys`): Tensor[seq].

    A first-order estimate of what removing token j everywhere does to the answer's log-probability
    (``b_j → −∞`` hides key j): positive = the answer leans on it. Unlike scores read off the
    answer rows, it includes indirect paths (a later token that copied token j). Summed over a
    source's tokens it estimates removing the source. One forward and one backward. On CPU the bias
    rides in the flash kernel (:mod:`probe.attention.flash_key_bias`), at about a plain pass's time and
    memory; on CUDA in compiled FlexAttention's score function (:mod:`probe.attention.flex_key_bias`).
    Elsewhere (other devices, soft-capped or sink logits) the backward of each layer materializes the
    attention of every row (``[heads, seq, seq]``), so without checkpointing every layer keeps its own:
    the key-bias modifier states its terms to the planner
    (:meth:`probe.attention.modifiers.KeyBias.memory`), and ``checkpoint="auto"`` recomputes one layer
    at a time when the plain pass would not fit.

    ``depth > 0``: the gradient integrated along the path that lowers every key's bias together from
    0 to −``depth`` (integrated gradients on the key biases, midpoint rule over ``steps`` points):
    ``depth · mean_k ∂ log P/∂b_j`` at ``b = −(k + ½)/steps · depth``. The scores then add up to
    log P(answer) − log P(answer | every bias −``depth``) (completeness, to the rule's error): the
    removal effect shared out along the way rather than its slope at the start. ``steps`` passes.

    ``sources``: token spans ``(start, end)`` removed as units. A query inside a key's own span then
    gets no bias on it: removing the span removes that query too, so its reading of the span is no
    path by which the removal reaches the answer. Tokens outside every span stay units of their own.

    ``kept``: BoolTensor[seq]; the other tokens are removed first and the gradient is taken in what is
    left: the pass runs only the kept tokens at their original positions
    (:func:`probe.attention.modifiers.original_positions`, exact as key masking; models without
    ``position_ids`` key-mask instead). Removed tokens score 0. The answer tokens and the rows that
    predict them, and every token after, must be kept.

    ``presence`` in (0, 1]: every token of ``sources`` starts at bias log(``presence``) (from the
    queries that get a bias on it), the rest at 0: the gradient at a context that holds each source
    with weight ``presence``. At ½ this is the mean-field estimate of each source's Banzhaf value (its
    mean removal effect when every other source is kept with probability ½; a key kept with
    probability p contributes p·e^s to a softmax denominator on average, as a key of bias log p does),
    from one pass; needs ``sources``.
    """
    depth = float(depth)
    if not depth >= 0:
        raise InvalidValueError(f"depth must be a bias depth >= 0 (0: the gradient at b = 0), got {depth}")
    steps = check_int(steps, "steps", minimum=1)
    if depth == 0 and steps != 1:
        raise InvalidValueError("steps > 1 needs depth > 0: the gradient at b = 0 is one pass")
    ids = check_input_ids(model, input_ids)
    targets = check_positions(target_positions, ids.shape[1], "target_positions", 1).to(ids.device)
    inner = hf_model(model)
    seq = ids.shape[1]
    units, start = weighted_sources(sources, presence, seq)
    positions, removal = torch.arange(seq), nullcontext()
    if kept is not None:
        kept = check_token_flags(kept, seq, "kept")
        check_before_answer(~kept[None], int(targets[0]) - 1)
        if compaction_supported(inner):
            positions = kept.nonzero()[:, 0]
            table = positions[None].to(ids.device)
            removal = compacted(inner, table)
            ids, targets = ids[:, table[0]], torch.searchsorted(table[0], targets)
            units, start = None if units is None else units[positions], start[positions]
        else:
            removal = mask_keys(inner, ~kept[None].to(ids.device))
    run = ids.shape[1]
    bias = torch.zeros(1, run, device=ids.device, requires_grad=True)
    start = start.to(ids.device)
    total = torch.zeros(run, device=ids.device)
    with (
        removal as forward,
        bias_keys(inner, bias, None if units is None else units.to(ids.device)),
        guarded(model, run, "embedding_grads", checkpoint, len(targets)),
        frozen_parameters(inner),
    ):
        for point in range(steps):
            with torch.no_grad():
                bias.copy_(start - (point + 0.5) / steps * depth)
            with torch.enable_grad():
                (grad,) = torch.autograd.grad(target_of(inner, ids, targets, target, **(forward or {})), bias)
            total += grad[0].detach().float()
    scores = torch.zeros(seq)
    scores[positions] = (total / steps * (depth or 1.0)).cpu()
    return scores


def removal_units(sources: Sequence[tuple[int, int]], seq: int) -> torch.Tensor:
    """LongTensor[seq]: one unit per span ``(start, end)`` of ``sources`` (end exclusive), and one per
    token outside them. Spans must lie in ``[0, seq)`` and not overlap."""
    units = torch.arange(seq)
    for index, (start, end) in enumerate(sources):
        start, end = check_int(start, f"sources[{index}] start"), check_int(end, f"sources[{index}] end")
        if not 0 <= start < end <= seq:
            raise InvalidValueError(f"sources[{index}] = ({start}, {end}) is not a span of the {seq} tokens")
        if (units[start:end] >= seq).any():
            raise InvalidValueError(f"sources[{index}] = ({start}, {end}) overlaps an earlier span")
        units[start:end] = seq + index
    return units


def weighted_sources(
    sources: Sequence[tuple[int, int]] | None, presence: float, seq: int, allowed: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the removal unit of each token, LongTensor[seq], or ``None`` without ``sources``; the key bias each
    token starts at, Tensor[seq]: log(``presence``) inside a source, 0 elsewhere). ``allowed``: whether the
    caller can weigh sources (one sequence with a key bias)."""
    presence = float(presence)
    if not 0 < presence <= 1:
        raise InvalidValueError(f"presence must be a weight in (0, 1] (1: the full context), got {presence}")
    if sources is not None and not allowed:
        raise InvalidValueError("sources weigh one sequence's key bias: give one sequence and key_bias=True")
    if presence < 1 and sources is None:
        raise InvalidValueError("presence < 1 weighs the sources' keys: pass sources=[(start, end), ...]")
    start = torch.zeros(seq)
    if sources is None:
        return None, start
    units = removal_units(sources, seq)
    start[units >= seq] = math.log(presence)  # tokens inside a source span
    return units, start
