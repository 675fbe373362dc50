"""Attention rows, full attention matrices, information flow and embedding gradients.

Every function here reads attention through :func:`probe.capture.trace`; none holds
full-vocabulary logits or all layers' full attention matrices. :func:`answer_attribution` gets
the answer rows' attention, its gradient and the input-embedding gradient from one
forward+backward pass, for every detector that needs any of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from probe.capture import (
    check_input_ids,
    check_layers,
    check_positions,
    frozen_parameters,
    hf_model,
    target_loss,
    trace,
)


@torch.no_grad()
def attention_rows(
    model,
    input_ids: torch.Tensor | Sequence[int],
    rows: Sequence[int],
    layers: Sequence[int] | None = None,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query ``rows`` over all keys: Tensor[layers, heads, len(rows), seq].

    One forward pass with the fused kernel; only the requested rows are recomputed.
    GQA models report one pattern per query head. ``inputs_embeds`` (Tensor[seq, hidden]) replaces
    the embeddings of ``input_ids`` (e.g. denoised embeddings, CDT eq. 2).
    """
    ids = check_input_ids(model, input_ids)
    rows = check_positions(rows, ids.shape[1], "rows")
    layers = check_layers(model, layers)
    inputs = _model_inputs(model, ids, inputs_embeds)
    with frozen_parameters(hf_model(model)), trace(model, rows=rows, layers=layers) as cache:
        hf_model(model)(**inputs, use_cache=False, logits_to_keep=1)
    return cache.stack("pattern", layers)


def _model_inputs(model, ids: torch.Tensor, inputs_embeds: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Forward kwargs: ``input_ids``, or ``inputs_embeds`` checked to be Tensor[seq, hidden] for ``ids``."""
    if inputs_embeds is None:
        return {"input_ids": ids}
    hidden = hf_model(model).get_input_embeddings().embedding_dim
    if inputs_embeds.shape != (ids.shape[1], hidden):
        raise ValueError(
            f"inputs_embeds must have shape [seq, hidden] = [{ids.shape[1]}, {hidden}], "
            f"got {tuple(inputs_embeds.shape)}"
        )
    return {"inputs_embeds": inputs_embeds[None].to(hf_model(model).device)}


@torch.no_grad()
def attention_matrices(
    model,
    input_ids: torch.Tensor | Sequence[int],
    layers: Sequence[int] | None = None,
    block_size: int = 256,
    on_layer: Callable[[int, torch.Tensor], None] | None = None,
) -> torch.Tensor | None:
    """Full attention matrices, computed in row blocks: Tensor[layers, heads, seq, seq].

    Meant for short sequences and for streamed consumers: with ``on_layer`` each layer's
    Tensor[heads, seq, seq] is handed over as soon as it is computed and nothing is stored
    (returns ``None``), so e.g. a product over layers needs memory for one layer at a time.
    """
    ids = check_input_ids(model, input_ids)
    layers = check_layers(model, layers)
    stream = None if on_layer is None else (lambda layer, pattern: on_layer(layer, pattern[0]))
    with (
        frozen_parameters(hf_model(model)),
        trace(model, layers=layers, block_size=block_size, on_pattern=stream) as cache,
    ):
        hf_model(model)(input_ids=ids, use_cache=False, logits_to_keep=1)
    return None if on_layer is not None else cache.stack("pattern", layers)


FLOW_REDUCTIONS = ("sum_then_abs", "abs_then_sum")


def _check_reduce(reduce: str) -> None:
    if reduce not in FLOW_REDUCTIONS:
        raise ValueError(f"reduce must be 'sum_then_abs' or 'abs_then_sum', got {reduce!r}")


def flow_from_pattern(
    pattern: torch.Tensor, pattern_grad: torch.Tensor, reduce: str = "sum_then_abs"
) -> torch.Tensor:
    """Information flow Tensor[layers, seq] from attention rows and their gradients, both
    Tensor[layers, heads, rows, seq] (see :func:`information_flow` for ``reduce``)."""
    _check_reduce(reduce)
    saliency = pattern * pattern_grad
    if reduce == "sum_then_abs":
        return saliency.sum(dim=1).abs().sum(dim=1)
    return saliency.abs().sum(dim=(1, 2))


def information_flow(
    model,
    input_ids: torch.Tensor | Sequence[int],
    target_positions: Sequence[int],
    layers: Sequence[int] | None = None,
    reduce: str = "sum_then_abs",
) -> torch.Tensor:
    """Information flow from each context token to the targets: Tensor[layers, seq].

    The IG score of CDT (seed 002, eq. 1) / the saliency of Wang et al. (2023):
    L = mean cross-entropy of the tokens at ``target_positions``, each predicted from row t − 1.
    Per layer l and key token i, summed over those rows r:

    - ``"sum_then_abs"``: Σ_r |Σ_h A_h[r, i] · ∂L/∂A_h[r, i]|  (heads combined before the abs,
      as the reference code does)
    - ``"abs_then_sum"``: Σ_r Σ_h |A_h[r, i] · ∂L/∂A_h[r, i]|  (the formula as printed in the seed)
    """
    _check_reduce(reduce)
    ids = check_input_ids(model, input_ids)
    targets = check_positions(target_positions, ids.shape[1], "target_positions", minimum=1)
    layers = check_layers(model, layers)
    with (
        frozen_parameters(hf_model(model)),
        torch.enable_grad(),
        trace(model, rows=targets - 1, layers=layers, grad=True) as cache,
    ):
        target_loss(model, ids, targets).backward()
    return flow_from_pattern(cache.stack("pattern", layers), cache.stack("pattern_grad", layers), reduce)


def embedding_grads(
    model,
    input_ids: torch.Tensor | Sequence[int],
    target_positions: Sequence[int],
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """∂L/∂e_i for each input embedding e_i: Tensor[seq, hidden] (CDT §4.1).

    Same loss as :func:`information_flow`; parameters are frozen, so only the gradient with
    respect to the input embeddings is computed. ``inputs_embeds`` (Tensor[seq, hidden]) replaces
    the embeddings of ``input_ids``; the loss still scores the tokens of ``input_ids``.
    """
    ids = check_input_ids(model, input_ids)
    targets = check_positions(target_positions, ids.shape[1], "target_positions", minimum=1)
    inner = hf_model(model)
    with frozen_parameters(inner), torch.enable_grad():
        embeds = inner.get_input_embeddings()(ids)[0] if inputs_embeds is None else inputs_embeds
        embeds = _model_inputs(model, ids, embeds.detach())["inputs_embeds"].requires_grad_(True)
        (grad,) = torch.autograd.grad(target_loss(model, ids, targets, inputs_embeds=embeds), embeds)
    return grad[0]


def embedding_grad_norms(
    model, input_ids: torch.Tensor | Sequence[int], target_positions: Sequence[int], p: float = 2
) -> torch.Tensor:
    """‖∂L/∂e_i‖_p for each input embedding e_i: Tensor[seq] (CDT §4.1, the cheap IG proxy)."""
    return embedding_grads(model, input_ids, target_positions).norm(p=p, dim=-1)


@dataclass(frozen=True)
class AnswerAttribution:
    """What one forward+backward pass for the answer loss yields (see :func:`answer_attribution`).

    ``pattern`` and ``pattern_grad``: Tensor[layers, heads, rows, seq], the attention of the answer
    rows (``rows`` = target positions − 1, LongTensor[rows]) over all keys and ∂L/∂A of those rows,
    for ``layers`` in that order. ``embedding_grad``: Tensor[seq, hidden], ∂L/∂e_i. L is the mean
    cross-entropy of the target tokens, as in :func:`information_flow` and :func:`embedding_grads`.
    """

    pattern: torch.Tensor
    pattern_grad: torch.Tensor
    embedding_grad: torch.Tensor
    layers: tuple[int, ...]
    rows: torch.Tensor

    def select(self, layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pattern, pattern_grad) of ``layers`` (non-negative indices among :attr:`layers`), in that order:
        each Tensor[len(layers), heads, rows, seq]."""
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise ValueError(
                f"layers {missing} were not captured; this attribution holds layers {list(self.layers)}"
            )
        index = torch.tensor([self.layers.index(layer) for layer in layers], dtype=torch.long)
        return self.pattern[index], self.pattern_grad[index]

    def information_flow(self, layers: Sequence[int], reduce: str = "sum_then_abs") -> torch.Tensor:
        """:func:`information_flow` of ``layers`` from the captured tensors: Tensor[len(layers), seq]."""
        return flow_from_pattern(*self.select(layers), reduce)

    def embedding_grad_norms(self, p: float = 2) -> torch.Tensor:
        """:func:`embedding_grad_norms` from the captured gradient: Tensor[seq]."""
        return self.embedding_grad.norm(p=p, dim=-1)


def answer_attribution(
    model,
    input_ids: torch.Tensor | Sequence[int],
    target_positions: Sequence[int],
    layers: Sequence[int] | None = None,
) -> AnswerAttribution:
    """Attention rows, their gradients and the input-embedding gradients from one pass.

    One forward (under :func:`probe.capture.trace` with ``grad=True``, the embeddings of
    ``input_ids`` fed as ``inputs_embeds`` that require grad) and one backward of the loss of
    :func:`information_flow`, parameters frozen. Equal to :func:`attention_rows` of rows
    ``target_positions − 1``, :func:`information_flow` and :func:`embedding_grads` computed
    separately (three passes, two of them with a backward), for ``layers`` (``None`` = all).
    """
    ids = check_input_ids(model, input_ids)
    targets = check_positions(target_positions, ids.shape[1], "target_positions", minimum=1)
    layers = check_layers(model, layers)
    inner = hf_model(model)
    rows = targets - 1
    with (
        frozen_parameters(inner),
        torch.enable_grad(),
        trace(model, rows=rows, layers=layers, grad=True) as cache,
    ):
        embeds = inner.get_input_embeddings()(ids).detach().requires_grad_(True)
        target_loss(model, ids, targets, inputs_embeds=embeds).backward()
    return AnswerAttribution(
        pattern=cache.stack("pattern", layers),
        pattern_grad=cache.stack("pattern_grad", layers),
        embedding_grad=embeds.grad[0],
        layers=tuple(layers),
        rows=rows.cpu(),
    )
