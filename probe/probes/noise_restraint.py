"""Context-noise restraint (CDT: Context Denoising Training, §3.2 and Fig. 4).

The embeddings of irrelevant context tokens are moved against the gradient of the answer loss,
E' = E − lr·β·∇E (CDT eq. 2), the critical tokens are left untouched, and the attention that the
answer rows pay to each category of token is compared before and after the move. The paper
reports that attention on the critical tokens grows about ×10 while attention on the irrelevant
tokens drops slightly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from probe.attention.capture import trace
from probe.attention.shared_state import frozen_parameters
from probe.checks import check_layers, check_number, check_token_flags, hf_model, input_device
from probe.errors import InvalidValueError
from probe.probes.attribution import critical_tokens, embedding_grads
from probe.target import target_loss
from probe.tasks import CATEGORIES, Sample, check_sample


def noise_tokens(grad_norms: torch.Tensor, context: int | None = None) -> torch.Tensor:
    """The tokens CDT moves: bool Tensor[seq], the first ``context`` tokens that are not critical.

    ~I(x_i) of eq. 1 (:func:`~probe.probes.attribution.critical_tokens`) restricted to the context: tokens
    at or after ``context`` (e.g. the answer) are never moved.
    """
    noise = ~critical_tokens(grad_norms, context)
    if context is not None:
        noise[context:] = False
    return noise


def denoised_embeddings(
    embeds: torch.Tensor, grads: torch.Tensor, move: torch.Tensor, lr: float, beta: float = 5.0
) -> torch.Tensor:
    """E' = E − lr·β·∇E on the tokens in ``move``, the others untouched (CDT eq. 2): Tensor[seq, hidden].

    ``embeds`` and ``grads`` are Tensor[seq, hidden], ``move`` a bool Tensor[seq]. The paper's text
    moves the irrelevant tokens (``move = ~critical``) and leaves critical ones unchanged; its
    eq. 2 as printed multiplies by I(x_i) = 1 for *critical* tokens — pass the mask you mean.
    The paper sets β = 5.
    """
    if embeds.shape != grads.shape or move.shape != embeds.shape[:1]:
        raise InvalidValueError(
            f"embeds {tuple(embeds.shape)}, grads {tuple(grads.shape)} and move {tuple(move.shape)} "
            "must be [seq, hidden], [seq, hidden] and [seq]"
        )
    return embeds - (lr * beta) * grads * move[:, None].to(grads)


#: Ground-truth categories moved by each named ``move`` (``"detected"``: see :func:`moved_tokens`).
#: ``"noise"`` moves CDT's irrelevant tokens (§3.1: book text and low-frequency words); the critical
#: tokens — supporting *and* interference facts (CDT footnote 2) — stay. ``"non_supporting"`` also
#: moves the interference facts, i.e. every categorised context token except the supporting facts.
MOVES = {
    "noise": ("noise", "low_frequency"),
    "non_supporting": ("noise", "low_frequency", "interference"),
}


def moved_tokens(sample: Sample, move: str | torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """The tokens whose embeddings eq. 2 moves: bool Tensor[seq].

    ``move`` is a name of :data:`MOVES` (ground-truth spans), ``"detected"`` (the prompt tokens that
    CDT eq. 1 does not flag as critical: ‖∇E(x_i)‖₂ below the mean over the prompt, see
    :func:`probe.probes.attribution.critical_tokens`; template and question tokens can be among them), or a
    bool Tensor[seq] of your own. ``grads`` is ∂L/∂E, Tensor[seq, hidden]. The ground-truth moves
    never touch the instruction, question, chat template or answer; ``"detected"`` never touches
    the answer.
    """
    seq = len(sample.input_ids)
    if isinstance(move, torch.Tensor):
        return check_token_flags(move, seq, "move")
    if move == "detected":
        return noise_tokens(grads.norm(dim=-1), context=sample.prompt_length)
    if move not in MOVES:
        raise InvalidValueError(f"move must be one of {[*MOVES, 'detected']} or a bool mask, got {move!r}")
    return torch.from_numpy(np.isin(sample.categories, MOVES[move]))


def category_mass(pattern: torch.Tensor, labels: np.ndarray) -> pd.DataFrame:
    """Attention mass per category: one column per category present in ``labels``, one row per layer.

    ``pattern`` is Tensor[layers, heads, rows, seq]; the mass of a category is the attention summed
    over its tokens, averaged over heads and rows. Over all categories it sums to 1 per layer.
    """
    per_token = pattern.mean(dim=(1, 2)).double().cpu().numpy()  # [layers, seq]
    categories = [c for c in (*CATEGORIES, "other") if c in labels]
    return pd.DataFrame({c: per_token[:, labels == c].sum(axis=1) for c in categories})


def noise_restraint(
    model,
    sample: Sample,
    lr: float | Sequence[float],
    beta: float = 5.0,
    move: str | torch.Tensor = "noise",
    layers: Sequence[int] | None = None,
    checkpoint: bool | str = "auto",
) -> pd.DataFrame:
    """Attention from the answer rows per layer and category, before and after CDT eq. 2.

    The loss L is the mean cross-entropy of the teacher-forced gold answer tokens (rows t − 1
    predict them). E = the model's own input embeddings of ``sample.input_ids`` (Tensor[seq, hidden]),
    ∇E = ∂L/∂E with the parameters frozen, and E' = E − lr·β·∇E on the tokens chosen by ``move``
    (see :func:`moved_tokens`), every other token untouched. ``lr`` may be a sequence: a sweep
    shares the gradient and the "before" pass.

    Returns one row per (lr, layer, category) with columns ``lr, beta, step`` (= lr·β), ``move,
    layer, category, tokens`` (tokens of the category), ``moved`` (of them moved), ``before, after``
    (attention mass, :func:`category_mass`), ``ratio`` (after / before; NaN where a sliding-window
    layer cannot see the category at all), ``loss_before, loss_after`` (L on E and on E') and
    ``shift`` (mean ‖E' − E‖ / ‖E‖ over the moved tokens). Moving against the gradient lowers L
    for small enough steps. ``checkpoint``: the gradient pass's (see :mod:`probe.probes.attribution`).
    """
    check_sample(sample)
    lrs = np.atleast_1d(np.asarray(lr, dtype=object)).tolist()
    if not lrs:
        raise InvalidValueError("lr is empty: give a step size or a list of them")
    for value in lrs:
        check_number(value, "lr")  # 0: no step; negative: a step along the gradient
    check_number(beta, "beta")
    ids, targets = sample.input_ids, sample.target_positions
    layers, labels = check_layers(model, layers), sample.categories
    with torch.no_grad():
        embeds = hf_model(model).get_input_embeddings()(ids.to(input_device(model)))
    grads = embedding_grads(model, ids, targets, inputs_embeds=embeds, checkpoint=checkpoint)
    moved = moved_tokens(sample, move, grads).cpu()
    before, loss_before = answer_attention(model, ids, targets, layers, embeds)
    before = category_mass(before, labels).set_axis(layers).stack()
    counts = pd.Series(labels).value_counts()
    moved_counts = pd.Series(labels[moved.numpy()]).value_counts().reindex(counts.index, fill_value=0)
    frames = []
    for step_lr in lrs:
        denoised = denoised_embeddings(embeds, grads, moved, step_lr, beta)
        after, loss_after = answer_attention(model, ids, targets, layers, denoised)
        after = category_mass(after, labels).set_axis(layers).stack()
        shift = ((denoised - embeds).norm(dim=-1) / embeds.norm(dim=-1))[moved].mean()
        frame = pd.DataFrame({"before": before, "after": after}).rename_axis(["layer", "category"])
        frames.append(
            frame.reset_index().assign(
                lr=step_lr,
                beta=beta,
                step=step_lr * beta,
                move=move if isinstance(move, str) else "mask",
                tokens=lambda f: f.category.map(counts),
                moved=lambda f: f.category.map(moved_counts),
                ratio=lambda f: f.after / f.before,
                loss_before=loss_before,
                loss_after=loss_after,
                shift=float(shift) if moved.any() else 0.0,
            )
        )
    return pd.concat(frames, ignore_index=True)[COLUMNS]


COLUMNS = [
    "lr", "beta", "step", "move", "layer", "category", "tokens", "moved",
    "before", "after", "ratio", "loss_before", "loss_after", "shift",
]  # fmt: skip


def answer_attention(
    model,
    input_ids: torch.Tensor,
    target_positions: torch.Tensor,
    layers: list[int],
    embeds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """One forward pass: (attention of the answer rows, L).

    The attention is Tensor[layers, heads, rows, seq] for rows ``target_positions − 1``, as
    :func:`probe.attention_rows` gives it; L is the mean cross-entropy of the tokens at
    ``target_positions`` (LongTensor[targets], e.g. ``sample.target_positions``). ``embeds``
    (Tensor[seq, hidden]) replaces the embeddings of ``input_ids``. Capturing both in one pass
    halves the forward passes of a sweep.
    """
    inner = hf_model(model)
    inputs = {} if embeds is None else {"inputs_embeds": embeds[None]}
    with (
        frozen_parameters(inner),
        torch.no_grad(),
        trace(model, rows=target_positions - 1, layers=layers) as cache,
    ):
        loss = target_loss(model, input_ids[None], target_positions, **inputs)
    return cache.stack("pattern", layers), float(loss)
