"""Ablation detectors: one score per source, from passes with sources removed (:mod:`probe.faithfulness`).

``leave_one_out`` removes sources one by one (or pruned, after AttriBoT); ``context_cite`` fits
ContextCite's sparse linear surrogate to random source subsets. Each token carries its source's score.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from probe.checks import check_number
from probe.detectors.registry import Detection, looked_up, options, register, shared_pass, spread_over_tokens
from probe.detectors.run import detect
from probe.errors import InvalidValueError
from probe.faithfulness import (
    AnswerScores,
    Passes,
    answer_scores,
    lds,
    leave_one_out_drops,
    random_masks,
    removal_drops,
    single_removals,
)
from probe.probes.attribution import answer_attribution
from probe.target import Target
from probe.tasks import Sample


@register("leave_one_out")
def leave_one_out(
    model,
    tokenizer,
    sample: Sample,
    reuse_prefix: bool = True,
    top_m: int | None = None,
    rank_by: str | Sequence[str] = "key_removal_grad",
    block: int = 1,
    refine: int = 4,
    target: Target | None = None,
    ranking: torch.Tensor | None = None,
    compact: bool | None = None,
) -> Detection:
    """Leave-one-out: a source's score is ``lp(full) − lp(without it)``, the drop of the gold answer's
    log-probability when it is removed (:func:`probe.faithfulness.answer_scores`), one pass per source.

    The gold standard of comprehensiveness at k = 1. Two cheaper forms, after AttriBoT (Liu et al.,
    ICLR 2025), exact where they measure:

    - ``top_m``: only the ``top_m`` sources ranked highest by detector ``rank_by`` are removed one by
      one; every other source scores ``rank_by``'s source score times the least-squares scale that maps
      it onto the measured drops (0 when fewer than two were measured). ``rank_by`` may name several
      detectors: then the union of each one's top ``top_m`` is removed (at most ``top_m`` a detector),
      and the first one scores the rest. ``ranking`` (Tensor[sources], or Tensor[rankers, sources], a
      row a ``rank_by`` detector): their source scores when they are at hand
      (:func:`~probe.detectors.detect_many` passes the detections it already made), so that they do not
      run again;
    - ``block > 1`` (hierarchical): each run of ``block`` consecutive sources is removed at once, then
      the ``refine`` blocks with the largest drops are split and their sources removed one by one;
      a source of an unrefined block scores its block's drop shared equally.

    ``details``: ``source_scores`` Tensor[sources], ``measured`` BoolTensor[sources] (the source's own
    removal was run), ``passes`` (masked passes, the full pass included), ``full_logprob``, and
    every pass's mask and answer scores: ``ablated`` BoolTensor[passes, sources], ``ablated_logprob``,
    ``ablated_correct`` (:meth:`probe.faithfulness.Ablations.of` reads them, so that
    :func:`~probe.faithfulness.evaluate` need not run those masks again). Each token carries its
    source's score. Flags the sources whose removal lowers the log-probability. ``reuse_prefix`` and
    ``compact`` (compaction or key masking; default: compaction where the model takes ``position_ids``):
    how each pass runs, see :func:`~probe.faithfulness.answer_scores`.
    """
    n_sources = len(sample.sources)
    if top_m is not None and block > 1:
        raise InvalidValueError("choose one way to prune leave-one-out: top_m or block > 1, not both")
    if block < 1 or refine < 0 or (top_m is not None and top_m < 1):
        raise InvalidValueError(
            f"block must be >= 1, refine >= 0 and top_m >= 1, got {block}, {refine}, {top_m}"
        )
    if ranking is not None and top_m is None:
        raise InvalidValueError(
            "ranking prunes leave-one-out to its top_m sources: give top_m too (or no ranking)"
        )
    rankers = looked_up(rank_by)  # every name, before any model work
    if not rankers or "leave_one_out" in rankers:
        raise InvalidValueError(
            f"rank_by must name one or more other detectors (e.g. 'key_removal_grad'), got {rank_by!r}"
        )
    settings = {
        "reuse_prefix": reuse_prefix,
        "top_m": top_m,
        "rank_by": rank_by,
        "block": block,
        "refine": refine,
        "compact": compact,
    }
    how = Passes(reuse_prefix=reuse_prefix, compact=compact, target=target)
    if top_m is not None:
        if ranking is None:
            ranking = torch.stack([ranker_scores(name, model, tokenizer, sample, target) for name in rankers])
        rankings = ranking.reshape(1, -1) if ranking.dim() == 1 else ranking
        if rankings.shape != (len(rankers), n_sources):
            raise InvalidValueError(
                f"ranking must hold one score per source ({n_sources}) for each of the {len(rankers)} "
                f"rank_by detectors, got shape {tuple(ranking.shape)}"
            )
        chosen = pruned_sources(rankings, top_m)
        drops, (removed, ran) = leave_one_out_drops(model, sample, chosen, how)
        effect = pruned_estimate(rankings[0], chosen, drops)
        measured = torch.zeros(n_sources, dtype=torch.bool)
        measured[chosen] = True
    elif block > 1:
        starts = torch.arange(0, n_sources, block)
        blocks = torch.zeros(len(starts), n_sources, dtype=torch.bool)
        for row, first in enumerate(starts.tolist()):
            blocks[row, first : first + block] = True
        block_drops, coarse = removal_drops(model, sample, blocks, how)
        refined = torch.argsort(-block_drops, stable=True)[:refine]
        chosen = blocks[refined].any(0).nonzero()[:, 0]
        single = single_removals(chosen, n_sources)
        fine = answer_scores(model, sample, single, how)
        effect = (blocks.float() * (block_drops / blocks.sum(1))[:, None]).sum(0)
        effect[chosen] = coarse.scores.logprob[0] - fine.logprob
        measured = blocks[refined].any(0)
        removed = torch.cat([coarse.removed, single])
        ran = AnswerScores(*(torch.cat(pair) for pair in zip(coarse.scores, fine, strict=True)))
    else:
        effect, (removed, ran) = leave_one_out_drops(model, sample, range(n_sources), how)
        measured = torch.ones(n_sources, dtype=torch.bool)
    return removal_detection(sample, effect, measured, settings, removed, ran, passes=len(removed))


def removal_detection(
    sample: Sample,
    effect: torch.Tensor,
    measured: torch.Tensor,
    settings: dict,
    removed: torch.Tensor,
    ran: AnswerScores,
    **details,
) -> Detection:
    """The detection of a removal detector: ``effect`` Tensor[sources] spread over each source's tokens,
    flagged where positive; ``details`` hold the certificate's ``source_scores`` and ``measured``
    BoolTensor[sources], ``full_logprob`` (row 0 of ``ran``) and every pass run, ``removed``
    BoolTensor[passes, sources] with its answer scores ``ran`` (read by :meth:`Ablations.of`), and
    ``details``."""
    scores = spread_over_tokens(effect, sample)
    return Detection(
        scores=scores,
        flagged=scores > 0,
        settings=settings,
        details={
            "source_scores": effect,
            "measured": measured,
            **details,
            "full_logprob": float(ran.logprob[0]),
            "ablated": removed,
            "ablated_logprob": ran.logprob,
            "ablated_correct": ran.correct,
        },
    )


def ranker_scores(name: str, model, tokenizer, sample: Sample, target: Target | None) -> torch.Tensor:
    """Tensor[sources]: the source scores by which detector ``name`` ranks for pruned leave-one-out,
    explaining ``target`` where the detector takes one."""
    explained = {"target": target} if "target" in options(name) else {}
    return detect(name, model, tokenizer, sample, **explained).source_scores(sample)


def pruned_sources(ranking: torch.Tensor, top_m: int) -> torch.Tensor:
    """LongTensor[≤ top_m a ranking]: the sources pruned leave-one-out removes one by one, the
    ``top_m`` that ``ranking`` scores highest (ties: the earlier source first). ``ranking``:
    Tensor[sources], or Tensor[rankers, sources]: the union of each row's ``top_m``, in the order
    the rows first name them."""
    tops = torch.argsort(-ranking.float().cpu().reshape(-1, ranking.shape[-1]), dim=1, stable=True)
    return torch.tensor(list(dict.fromkeys(tops[:, :top_m].flatten().tolist())), dtype=torch.long)


def pruned_estimate(ranking: torch.Tensor, chosen: torch.Tensor, drops: torch.Tensor) -> torch.Tensor:
    """Tensor[sources]: pruned leave-one-out's scores: the measured ``drops`` Tensor[chosen] on the
    ``chosen`` sources (:func:`pruned_sources`; measuring only a cheap ranking's top sources exactly is
    AttriBoT's pruning, Liu et al. ICLR 2025), every other source its ``ranking`` score times the
    least-squares scale that maps the ranking onto the drops (0 when fewer than two were measured; the
    scale is ours: AttriBoT leaves the rest with the cheap ranking's own scores)."""
    effect = ranking.float().cpu() * pruned_scale(ranking, chosen, drops)
    effect[chosen] = drops
    return effect


def pruned_scale(ranking: torch.Tensor, chosen: torch.Tensor, drops: torch.Tensor) -> float:
    """The least-squares scale that maps ``ranking``'s scores of the ``chosen`` sources onto their measured
    ``drops`` (0 when fewer than two were measured)."""
    cheap = ranking.float().cpu()[chosen]
    return float(cheap @ drops / (cheap @ cheap)) if len(chosen) > 1 else 0.0


def lasso_surrogate(
    kept: torch.Tensor, target: torch.Tensor, alpha: float
) -> tuple[torch.Tensor, Callable[[torch.Tensor], np.ndarray]]:
    """ContextCite's surrogate (Cohen-Wang et al. 2024): scikit-learn's LASSO (``alpha``) from the
    standardized kept-source indicators ``kept`` (BoolTensor[masks, sources]) to ``target`` (Tensor[masks]).

    Returns the weights in target units per source kept (Tensor[sources]; a source kept by every mask or by
    none gets 0) and the surrogate's prediction for other masks (BoolTensor[masks, sources] → [masks]).
    """
    from sklearn.linear_model import Lasso
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(kept.double().numpy())
    lasso = Lasso(alpha=alpha).fit(scaler.transform(kept.double().numpy()), target.double().numpy())
    weights = torch.tensor(lasso.coef_ / np.where(scaler.scale_ > 0, scaler.scale_, 1.0), dtype=torch.float32)
    return weights, lambda other: lasso.predict(scaler.transform(other.double().numpy()))


@register("context_cite")
def context_cite(
    model,
    tokenizer,
    sample: Sample,
    n_masks: int = 64,
    keep: float = 0.5,
    alpha: float = 0.01,
    holdout: float = 0.25,
    seed: int = 1,
    target: Target | None = None,
    compact: bool | None = None,
) -> Detection:
    """ContextCite's surrogate (Cohen-Wang et al. 2024): remove random subsets of the sources (each
    kept with probability ``keep``; ``compact`` as :func:`~probe.faithfulness.answer_scores`), fit a
    sparse linear model (scikit-learn LASSO, ``alpha``, on standardized masks) from the kept-source
    indicators to the gold answer's log-probability; a source's score is its weight in
    log-probability per source kept.

    The target is the log-probability (ContextCite uses the logit-probability log p − log(1 − p)).
    A ``holdout`` share of the masks is left out of the fit: ``details["heldout_spearman"]`` and
    ``details["heldout_r2"]`` say how well the surrogate predicts them (read them before trusting
    the weights). ``seed`` must differ from the seed of the masks a faithfulness evaluation uses.
    Flags the sources with positive weight.
    """
    from sklearn.metrics import r2_score

    check_number(keep, "keep", 0, 1, open_below=True)
    check_number(alpha, "alpha", 0)
    check_number(holdout, "holdout", 0, 0.5)
    if n_masks - max(1, round(holdout * n_masks)) < 2:
        raise InvalidValueError(f"n_masks={n_masks} leaves under 2 masks to fit beside holdout={holdout}")
    n_sources = len(sample.sources)
    kept = random_masks(n_sources, n_masks, keep, seed)
    logprob = answer_scores(model, sample, ~kept, Passes(compact=compact, target=target)).logprob
    n_fit = n_masks - max(1, round(holdout * n_masks))
    weights, predict = lasso_surrogate(kept[:n_fit], logprob[:n_fit], alpha)
    predicted = predict(kept[n_fit:])
    scores = spread_over_tokens(weights, sample)
    return Detection(
        scores=scores,
        flagged=scores > 0,
        settings={
            "n_masks": n_masks,
            "keep": keep,
            "alpha": alpha,
            "holdout": holdout,
            "seed": seed,
            "compact": compact,
        },
        details={
            "source_scores": weights,
            "heldout_spearman": lds(weights, kept[n_fit:], logprob[n_fit:]),
            "heldout_r2": float(r2_score(logprob[n_fit:].numpy(), predicted)),
        },
    )


@register("leave_few_out")
def leave_few_out(
    model,
    tokenizer,
    sample: Sample,
    measure: int = 2,
    rank_by: str | Sequence[str] = ("key_removal_grad", "information_flow"),
    presence: float = 0.5,
    check: int = 3,
    target: Target | None = None,
    reuse_prefix: bool = True,
    compact: bool | None = None,
    checkpoint: bool | str = "auto",
) -> Detection:
    """Leave-one-out where it matters, a first-order estimate elsewhere. One forward+backward pass at
    ``presence`` (every source's keys weighted by it: :func:`weighted_rankings`) gives each source's
    key-removal gradient there and the ``rank_by`` detectors' scores; the sources each of them puts in
    its top ``measure`` are removed one by one and score their exact drops; every other source scores its
    key-removal gradient as it is; then the top ``check`` sources of the result are removed together,
    once, to check the ranking's head.

    Why: at ``presence`` ½ the key-removal gradient is the mean-field estimate of a source's Banzhaf
    value (its mean removal effect over random half contexts, what LDS rewards; ``key_removal_banzhaf``),
    in log-probability units, so it needs no rescaling beside exact drops. A slope cannot see a step:
    where the answer is copied from one source, its log-probability is a step in that source's key bias
    and the slope may rank it low; information flow (CDT eq. 1) sees the copy in the attention, so the
    union of both tops holds it and its exact removal scores it.

    The certificate, in ``details``: ``measured`` BoolTensor[sources] (removed one by one) and
    ``source_scores`` (their exact drops there), ``estimated_by`` and ``scale`` (how the rest were scored),
    ``head`` LongTensor[check] (the top sources), ``head_drop`` (the measured drop when they are removed
    together) beside ``head_sum`` (the sum of their scores): far apart, the head's sources overlap or
    back each other up, and their individual scores do not add. Also ``passes`` (the weighted pass and
    every masked pass, the full context included), ``full_logprob`` and every masked pass
    (:meth:`probe.faithfulness.Ablations.of`). Options as :func:`leave_one_out`'s; ``checkpoint`` as
    :func:`~probe.probes.attribution.answer_attribution`'s.
    """
    for name, value in (("measure", measure), ("check", check)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidValueError(f"{name} must be a positive number of sources, got {value!r}")
    settings = {"measure": measure, "rank_by": looked_up(rank_by), "presence": presence, "check": check,
                "reuse_prefix": reuse_prefix, "compact": compact}  # fmt: skip
    rankings, slope = weighted_rankings(model, sample, rank_by, presence, target, checkpoint)
    how = Passes(reuse_prefix=reuse_prefix, compact=compact, target=target)
    chosen = pruned_sources(rankings, measure)
    drops, (removed, ran) = leave_one_out_drops(model, sample, chosen, how)
    effect = slope.clone()
    effect[chosen] = drops
    head = torch.argsort(-effect, stable=True)[: min(check, len(effect))]
    together = torch.zeros(1, len(effect), dtype=torch.bool)
    together[0, head] = True
    joint = answer_scores(model, sample, together, how)
    measured = torch.zeros(len(effect), dtype=torch.bool)
    measured[chosen] = True
    return removal_detection(
        sample,
        effect,
        measured,
        settings,
        torch.cat([removed, together]),
        AnswerScores(*(torch.cat(pair) for pair in zip(ran, joint, strict=True))),
        estimated_by=f"key-removal gradient at presence {presence}",
        scale=1.0,
        head=head,
        head_drop=float(ran.logprob[0] - joint.logprob[0]),
        head_sum=float(effect[head].sum()),
        passes=1 + len(removed) + 1,
    )


def weighted_rankings(
    model,
    sample: Sample,
    rank_by: str | Sequence[str],
    presence: float = 0.5,
    target: Target | None = None,
    checkpoint: bool | str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ``rank_by`` detectors' source scores, Tensor[rankers, sources]; each source's key-removal
    gradient, Tensor[sources]), all from one forward+backward pass
    (:func:`~probe.probes.attribution.answer_attribution`) in which every source's keys weigh
    ``presence`` (bias log ``presence``; sources removed as units). ``rank_by``: readers of the shared
    pass that read gradients."""
    rankers = looked_up(rank_by)
    passes = [shared_pass(name) for name in rankers]
    if not rankers or any(found is None or not found[0].backward for found in passes):
        raise InvalidValueError(
            f"rank_by must name detectors that read the shared forward+backward pass, got {rank_by!r}"
        )
    layers = sorted({layer for needs, read in passes for layer in needs.layers_of(model, read, {})})
    spans = [(source.start, source.end) for source in sample.sources]
    attribution = answer_attribution(
        model, sample.input_ids, sample.target_positions, layers or [0], checkpoint, target=target,
        key_bias=True, sources=spans, presence=presence,
    )  # fmt: skip
    rankings = torch.stack([read(model, attribution, sample).source_scores(sample) for _, read in passes])
    gradient = attribution.key_removal_gradient().float().cpu()
    slope = torch.stack([gradient[source.start : source.end].sum() for source in sample.sources])
    return rankings, slope
