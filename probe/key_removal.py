"""The key-removal gradient: a first-order estimate, from one forward and backward, of what removing a
context token everywhere (every later query of every layer and head) does to the answer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from probe.checks import check_input_ids, check_int, check_positions, hf_model
from probe.modifiers import bias_keys
from probe.planner import guarded
from probe.shared_state import frozen_parameters
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
) -> torch.Tensor:
    """∂ log P(answer) / ∂b_j at b = 0 (``target``: of another number about the answer, see
    :mod:`probe.target`), where b_j is added to the attention logit of key j from every
    later query, in every layer and head (:func:`probe.modifiers.bias_keys`): Tensor[seq].

    A first-order estimate of what removing token j everywhere does to the answer's log-probability
    (``b_j → −∞`` hides key j): positive = the answer leans on it. Unlike scores read off the
    answer rows, it includes indirect paths (a later token that copied token j). Summed over a
    source's tokens it estimates removing the source. One forward and one backward; the backward of
    each layer materializes the attention of every row (``[heads, seq, seq]``), so without
    checkpointing every layer keeps its own: the key-bias modifier states that term to the planner
    (:meth:`probe.modifiers.KeyBias.memory`), and ``checkpoint="auto"`` recomputes one layer at a time
    when the plain pass would not fit.

    ``depth > 0``: the gradient integrated along the path that lowers every key's bias together from
    0 to −``depth`` (integrated gradients on the key biases, midpoint rule over ``steps`` points):
    ``depth · mean_k ∂ log P/∂b_j`` at ``b = −(k + ½)/steps · depth``. The scores then add up to
    log P(answer) − log P(answer | every bias −``depth``) (completeness, to the rule's error): the
    removal effect shared out along the way rather than its slope at the start. ``steps`` passes.

    ``sources``: token spans ``(start, end)`` removed as units. A query inside a key's own span then
    gets no bias on it: removing the span removes that query too, so its reading of the span is no
    path by which the removal reaches the answer. Tokens outside every span stay units of their own.
    """
    depth = float(depth)
    if not depth >= 0:
        raise ValueError(f"depth must be a bias depth >= 0 (0: the gradient at b = 0), got {depth}")
    steps = check_int(steps, "steps", minimum=1)
    if depth == 0 and steps != 1:
        raise ValueError("steps > 1 needs depth > 0: the gradient at b = 0 is one pass")
    ids = check_input_ids(model, input_ids)
    targets = check_positions(target_positions, ids.shape[1], "target_positions", 1).to(ids.device)
    inner = hf_model(model)
    seq = ids.shape[1]
    units = None if sources is None else removal_units(sources, seq)
    bias = torch.zeros(1, seq, device=ids.device, requires_grad=True)
    total = torch.zeros(seq, device=ids.device)
    with (
        bias_keys(inner, bias, units),
        guarded(model, seq, "embedding_grads", checkpoint, len(targets)),
        frozen_parameters(inner),
    ):
        for point in range(steps):
            with torch.no_grad():
                bias.fill_(-(point + 0.5) / steps * depth)
            with torch.enable_grad():
                (grad,) = torch.autograd.grad(target_of(inner, ids, targets, target), bias)
            total += grad[0].detach().float()
    return (total / steps * (depth or 1.0)).cpu()


def removal_units(sources: Sequence[tuple[int, int]], seq: int) -> torch.Tensor:
    """LongTensor[seq]: one unit per span ``(start, end)`` of ``sources`` (end exclusive), and one per
    token outside them. Spans must lie in ``[0, seq)`` and not overlap."""
    units = torch.arange(seq)
    for index, (start, end) in enumerate(sources):
        start, end = check_int(start, f"sources[{index}] start"), check_int(end, f"sources[{index}] end")
        if not 0 <= start < end <= seq:
            raise ValueError(f"sources[{index}] = ({start}, {end}) is not a span of the {seq} tokens")
        if (units[start:end] >= seq).any():
            raise ValueError(f"sources[{index}] = ({start}, {end}) overlaps an earlier span")
        units[start:end] = seq + index
    return units
