"""Attention rows, full attention matrices, information flow and embedding gradients.

Every function here reads attention through :func:`probe.attention.capture.trace`; none holds
full-vocabulary logits or all layers' full attention matrices. Each checks its memory plan first
(:func:`probe.memory.planner.guarded`: a clear :class:`~probe.memory.planner.InsufficientMemoryError` instead
of
being killed), and the gradient probes take ``checkpoint=False | True | "auto"``: decoder layers
recomputed in the backward pass (:func:`probe.memory.checkpointing.checkpointed`), same result, activation
memory
O(seq·hidden·layers); ``"auto"`` (the default) turns it on when the plain pass would not fit.
:func:`answer_attribution` gets the answer rows' attention, its gradient and the input-embedding
gradient from one forward+backward pass, for every detector that needs any of them.

Every function takes one sequence or several (:mod:`probe.attention.batch`, one pass for all): one sequence
(LongTensor[seq] or [1, seq], a list of ids; its positions a list) gives one result, several (a list
of sequences or a padded batch with ``attention_mask``; a list of positions each) a list, one a sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from probe.attention.batch import Batch, batch_loss, batch_of, is_batch
from probe.attention.capture import trace
from probe.attention.modifiers import bias_keys
from probe.attention.shared_state import frozen_parameters
from probe.checks import check_input_ids, check_integers, check_layers, hf_model, input_device
from probe.errors import InvalidValueError
from probe.memory.planner import guarded
from probe.probes.key_removal import weighted_sources
from probe.target import Target

Ids = torch.Tensor | Sequence[int] | Sequence[torch.Tensor] | Sequence[Sequence[int]]
OneIds = torch.Tensor | Sequence[int]  # one sequence: LongTensor[seq] / [1, seq], or a list of ids
Positions = torch.Tensor | Sequence[int]  # positions in one sequence
EachPositions = Sequence[torch.Tensor] | Sequence[Sequence[int]]  # one list of positions per sequence


def _batch(model, input_ids: Ids, positions, attention_mask, what: str, minimum: int) -> tuple[Batch, bool]:
    """(the sequences as a :class:`~probe.attention.batch.Batch`, whether one sequence was given)."""
    if is_batch(input_ids, attention_mask):
        return batch_of(model, input_ids, positions, attention_mask, what, minimum), False
    ids = check_input_ids(model, input_ids)
    return batch_of(model, ids, [check_integers(positions, what)], None, what, minimum), True


def _per_sequence(cache, kind: str, layers: list[int], batch: Batch, b: int) -> torch.Tensor:
    """Sequence ``b``'s captured rows over its own keys: Tensor[layers, heads, rows_b, seq_b]."""
    stacked = torch.stack([cache[kind, layer][b] for layer in layers])  # [layers, heads, union, seq]
    return stacked[:, :, batch.index(b), : batch.lengths[b]]


def _one_or_all(results: list, single: bool):
    return results[0] if single else results


@torch.no_grad()
def attention_rows(
    model,
    input_ids: Ids,
    rows: Positions | EachPositions,
    layers: Sequence[int] | None = None,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Attention of query ``rows`` over all keys: Tensor[layers, heads, len(rows), seq].

    One forward pass with the fused kernel; only the requested rows are recomputed.
    GQA models report one pattern per query head. ``inputs_embeds`` (Tensor[seq, hidden]) replaces
    the embeddings of ``input_ids`` (e.g. denoised embeddings, CDT eq. 2). Several sequences
    (:mod:`probe.attention.batch`: a list, or ``[batch, seq]`` with ``attention_mask``) with one list of
    ``rows`` each run as one pass and give one such tensor per sequence, over its own tokens.
    """
    batch, single = _batch(model, input_ids, rows, attention_mask, "rows", 0)
    if inputs_embeds is not None and not single:
        raise InvalidValueError(
            "inputs_embeds replaces the embeddings of one sequence; pass one sequence with it"
        )
    layers = check_layers(model, layers)
    inputs = _model_inputs(model, batch.input_ids, inputs_embeds)
    with (
        guarded(
            model, batch.input_ids.shape[1], "attention_rows", False, len(batch.union), len(batch), layers
        ),
        frozen_parameters(hf_model(model)),
        trace(model, rows=batch.union, layers=layers) as cache,
    ):
        hf_model(model)(**inputs, use_cache=False, logits_to_keep=1)
    return _one_or_all([_per_sequence(cache, "pattern", layers, batch, b) for b in range(len(batch))], single)


def _model_inputs(model, ids: torch.Tensor, inputs_embeds: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Forward kwargs: ``input_ids``, or ``inputs_embeds`` checked to be Tensor[seq, hidden] for ``ids``."""
    if inputs_embeds is None:
        return {"input_ids": ids}
    hidden = hf_model(model).get_input_embeddings().embedding_dim
    if inputs_embeds.shape != (ids.shape[1], hidden):
        raise InvalidValueError(
            f"inputs_embeds must have shape [seq, hidden] = [{ids.shape[1]}, {hidden}], "
            f"got {tuple(inputs_embeds.shape)}"
        )
    return {"inputs_embeds": inputs_embeds[None].to(input_device(model))}


@torch.no_grad()
def attention_matrices(
    model,
    input_ids: OneIds,
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
        raise InvalidValueError(f"reduce must be 'sum_then_abs' or 'abs_then_sum', got {reduce!r}")


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
    input_ids: Ids,
    target_positions: Positions | EachPositions,
    layers: Sequence[int] | None = None,
    reduce: str = "sum_then_abs",
    checkpoint: bool | str = "auto",
    attention_mask: torch.Tensor | None = None,
    target: Target | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Information flow from each context token to the targets: Tensor[layers, seq].

    The IG score of CDT (Context Denoising Training, eq. 1) / the saliency of Wang et al. (2023):
    L = mean cross-entropy of the tokens at ``target_positions``, each predicted from row t − 1
    (``target``: another number about them, L = −target / k; see :mod:`probe.target`).
    Per layer l and key token i, summed over those rows r:

    - ``"sum_then_abs"``: Σ_r |Σ_h A_h[r, i] · ∂L/∂A_h[r, i]|  (heads combined before the abs,
      as the reference code does)
    - ``"abs_then_sum"``: Σ_r Σ_h |A_h[r, i] · ∂L/∂A_h[r, i]|  (the formula as printed in the seed)

    Several sequences (:mod:`probe.attention.batch`), one list of ``target_positions`` each: one
    forward+backward of the sum of their losses, one Tensor[layers, seq_b] per sequence.
    """
    _check_reduce(reduce)
    batch, single = _batch(model, input_ids, target_positions, attention_mask, "target_positions", 1)
    layers = check_layers(model, layers)
    with (
        guarded(
            model,
            batch.input_ids.shape[1],
            "information_flow",
            checkpoint,
            len(batch.union),
            len(batch),
            layers,
        ),
        frozen_parameters(hf_model(model)),
        torch.enable_grad(),
        trace(model, rows=batch.union - 1, layers=layers, grad=True) as cache,
    ):
        batch_loss(model, batch, target).backward()
    flows = [
        flow_from_pattern(
            _per_sequence(cache, "pattern", layers, batch, b),
            _per_sequence(cache, "pattern_grad", layers, batch, b),
            reduce,
        )
        for b in range(len(batch))
    ]
    return _one_or_all(flows, single)


def embedding_grads(
    model,
    input_ids: Ids,
    target_positions: Positions | EachPositions,
    inputs_embeds: torch.Tensor | None = None,
    checkpoint: bool | str = "auto",
    attention_mask: torch.Tensor | None = None,
    target: Target | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """∂L/∂e_i for each input embedding e_i: Tensor[seq, hidden] (CDT §4.1).

    Same loss as :func:`information_flow`; parameters are frozen, so only the gradient with
    respect to the input embeddings is computed. ``inputs_embeds`` (Tensor[seq, hidden]) replaces
    the embeddings of ``input_ids``; the loss still scores the tokens of ``input_ids``. Several
    sequences (:mod:`probe.attention.batch`): one pass, one Tensor[seq_b, hidden] per sequence.
    """
    batch, single = _batch(model, input_ids, target_positions, attention_mask, "target_positions", 1)
    if inputs_embeds is not None and not single:
        raise InvalidValueError(
            "inputs_embeds replaces the embeddings of one sequence; pass one sequence with it"
        )
    inner = hf_model(model)
    with (
        guarded(model, batch.input_ids.shape[1], "embedding_grads", checkpoint, len(batch.union), len(batch)),
        frozen_parameters(inner),
        torch.enable_grad(),
    ):
        if inputs_embeds is None:
            embeds = inner.get_input_embeddings()(batch.input_ids)
        else:
            embeds = _model_inputs(model, batch.input_ids, inputs_embeds)["inputs_embeds"]
        embeds = embeds.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(batch_loss(model, batch, target, inputs_embeds=embeds), embeds)
    return _one_or_all([grad[b, : batch.lengths[b]] for b in range(len(batch))], single)


def embedding_grad_norms(
    model,
    input_ids: Ids,
    target_positions: Positions | EachPositions,
    p: float = 2,
    checkpoint: bool | str = "auto",
    attention_mask: torch.Tensor | None = None,
    target: Target | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """‖∂L/∂e_i‖_p for each input embedding e_i: Tensor[seq] (CDT §4.1, the cheap IG proxy);
    one per sequence for several (see :func:`embedding_grads`)."""
    grads = embedding_grads(model, input_ids, target_positions, None, checkpoint, attention_mask, target)
    if isinstance(grads, torch.Tensor):
        return _norms(grads, p)
    return [_norms(grad, p) for grad in grads]


def critical_tokens(grad_norms: torch.Tensor, context: int | None = None) -> torch.Tensor:
    """The critical tokens of CDT (Context Denoising Training) eq. 1, I(x_i): bool Tensor[seq],
    ‖∇E(x_i)‖₂ ≥ t with t the mean norm (``grad_norms``: :func:`embedding_grad_norms`).

    The mean runs over the first ``context`` tokens (all tokens if ``None``, as printed in the
    paper); tokens at or after ``context`` are never critical.
    """
    context = len(grad_norms) if context is None else context
    if not 0 < context <= len(grad_norms):
        raise InvalidValueError(f"context must be in [1, {len(grad_norms)}], got {context}")
    critical = torch.zeros(len(grad_norms), dtype=torch.bool, device=grad_norms.device)
    critical[:context] = grad_norms[:context] >= grad_norms[:context].mean()
    return critical


def _norms(grads: torch.Tensor, p: float) -> torch.Tensor:
    """‖grads‖_p over the last dimension, in at least float32 (a bf16 model's gradients too)."""
    return grads.to(torch.promote_types(grads.dtype, torch.float32)).norm(p=p, dim=-1)


@dataclass(frozen=True)
class AnswerAttribution:
    """What one forward+backward pass for the answer loss yields (see :func:`answer_attribution`).

    ``pattern`` and ``pattern_grad``: Tensor[layers, heads, rows, seq], the attention of the answer
    rows (``rows`` = target positions − 1, LongTensor[rows]) over all keys and ∂L/∂A of those rows,
    for ``layers`` in that order. ``embedding_grad``: Tensor[seq, hidden], ∂L/∂e_i, and
    ``embeddings`` Tensor[seq, hidden], the e_i. L is the mean cross-entropy of the target tokens,
    as in :func:`information_flow` and :func:`embedding_grads`. A forward-only attribution
    (:meth:`forward_only`) holds the pattern alone, its gradients ``None``. ``key_bias_grad``:
    Tensor[seq], ∂L/∂b_j of a key bias at 0 (:func:`probe.attention.modifiers.bias_keys`), when the pass had
    one.
    """

    pattern: torch.Tensor
    pattern_grad: torch.Tensor | None
    embedding_grad: torch.Tensor | None
    embeddings: torch.Tensor | None
    layers: tuple[int, ...]
    rows: torch.Tensor
    key_bias_grad: torch.Tensor | None = None

    @classmethod
    def forward_only(
        cls, pattern: torch.Tensor, layers: Sequence[int], target_positions: torch.Tensor
    ) -> AnswerAttribution:
        """The attribution of a forward pass: :func:`attention_rows` ``pattern`` of rows
        ``target_positions − 1`` for ``layers``, no gradients."""
        rows = torch.as_tensor(target_positions).cpu() - 1
        return cls(pattern, None, None, None, tuple(layers), rows)

    def select(self, layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(pattern, pattern_grad) of ``layers`` (non-negative indices among :attr:`layers`), in that order:
        each Tensor[len(layers), heads, rows, seq]."""
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise InvalidValueError(
                f"layers {missing} were not captured; this attribution holds layers {list(self.layers)}"
            )
        index = torch.tensor([self.layers.index(layer) for layer in layers], dtype=torch.long)
        return self.pattern[index], None if self.pattern_grad is None else self.pattern_grad[index]

    def information_flow(self, layers: Sequence[int], reduce: str = "sum_then_abs") -> torch.Tensor:
        """:func:`information_flow` of ``layers`` from the captured tensors: Tensor[len(layers), seq]."""
        return flow_from_pattern(*self.select(layers), reduce)

    def embedding_grad_norms(self, p: float = 2) -> torch.Tensor:
        """:func:`embedding_grad_norms` from the captured gradient: Tensor[seq]."""
        return _norms(self.embedding_grad, p)

    def grad_times_input(self) -> torch.Tensor:
        """e_i · ∂ log P(answer)/∂e_i (gradient × input; Shrikumar et al. 2016, Denil et al. 2014):
        Tensor[seq], the first-order drop of the answer's log-probability, Σ_t log P(x_t | x_<t), when
        e_i is set to zero. L is a mean over the answer's tokens, so ∂ log P/∂e = −len(rows)·∂L/∂e."""
        return -len(self.rows) * (self.embeddings.float() * self.embedding_grad.float()).sum(-1)

    def key_removal_gradient(self) -> torch.Tensor:
        """:func:`probe.probes.key_removal.key_removal_gradient` from the captured key-bias gradient:
        Tensor[seq],
        ∂ log P(answer)/∂b_j = −len(rows)·∂L/∂b_j (needs a pass with ``key_bias=True``)."""
        if self.key_bias_grad is None:
            raise InvalidValueError(
                "this attribution's pass had no key bias: run answer_attribution(key_bias=True)"
            )
        return -len(self.rows) * self.key_bias_grad.float()


def answer_attribution(
    model,
    input_ids: Ids,
    target_positions: Positions | EachPositions,
    layers: Sequence[int] | None = None,
    checkpoint: bool | str = "auto",
    attention_mask: torch.Tensor | None = None,
    target: Target | None = None,
    key_bias: bool = False,
    sources: Sequence[tuple[int, int]] | None = None,
    presence: float = 1.0,
) -> AnswerAttribution | list[AnswerAttribution]:
    """Attention rows, their gradients and the input-embedding gradients from one pass.

    One forward (under :func:`probe.attention.capture.trace` with ``grad=True``, the embeddings of
    ``input_ids`` fed as ``inputs_embeds`` that require grad) and one backward of the loss of
    :func:`information_flow`, parameters frozen. Equal to :func:`attention_rows` of rows
    ``target_positions − 1``, :func:`information_flow` and :func:`embedding_grads` computed
    separately (three passes, two of them with a backward), for ``layers`` (``None`` = all).
    Several sequences (:mod:`probe.attention.batch`): one pass for all, one attribution per sequence.

    ``key_bias``: the same pass also holds a key bias at 0 on every token
    (:func:`probe.attention.modifiers.bias_keys`, the model unchanged) and keeps its gradient, so
    :meth:`AnswerAttribution.key_removal_gradient` equals
    :func:`probe.probes.key_removal.key_removal_gradient`
    without a pass of its own (a trace and a key bias compose:
    :attr:`probe.attention.patterns.Logits.key_bias`).
    ``sources`` and ``presence`` (one sequence, with ``key_bias``) as
    :func:`~probe.probes.key_removal.key_removal_gradient`'s: the spans are removal units, and at
    ``presence`` < 1 every source token's bias starts at log(``presence``), so the whole pass (the
    attention rows, their gradients, the key-bias gradient) reads the context that holds each source with
    that weight: at ½ the mean-field point of random half contexts.
    """
    batch, single = _batch(model, input_ids, target_positions, attention_mask, "target_positions", 1)
    layers = check_layers(model, layers)
    inner = hf_model(model)
    seq = batch.input_ids.shape[1]
    units, start = weighted_sources(sources, presence, seq, key_bias and single)
    device = batch.input_ids.device
    bias = start.to(device).expand(len(batch), seq).clone().requires_grad_(key_bias)
    with (
        bias_keys(inner, bias, None if units is None else units.to(device)) if key_bias else nullcontext(),
        guarded(model, seq, "answer_attribution", checkpoint, len(batch.union), len(batch), layers),
        frozen_parameters(inner),
        torch.enable_grad(),
        trace(model, rows=batch.union - 1, layers=layers, grad=True) as cache,
    ):
        embeds = inner.get_input_embeddings()(batch.input_ids).detach().requires_grad_(True)
        batch_loss(model, batch, target, inputs_embeds=embeds).backward()
    found = [
        AnswerAttribution(
            pattern=_per_sequence(cache, "pattern", layers, batch, b),
            pattern_grad=_per_sequence(cache, "pattern_grad", layers, batch, b),
            embedding_grad=embeds.grad[b, : batch.lengths[b]],
            embeddings=embeds.detach()[b, : batch.lengths[b]],
            layers=tuple(layers),
            rows=(batch.positions[b] - 1).cpu(),
            key_bias_grad=bias.grad[b, : batch.lengths[b]] if key_bias else None,
        )
        for b in range(len(batch))
    ]
    return _one_or_all(found, single)
