"""Causal faithfulness: remove or keep a sample's sources and watch the gold answer's log-probability.

A detector is *plausible* when its scores overlap the planted spans (:mod:`probe.metrics`) and
*faithful* when the tokens it ranks highest are the ones the prediction depends on. Faithfulness
is measured by ablation, the same masks for every detector:

- **comprehensiveness** (ERASER, DeYoung et al. 2020): the drop of the gold answer's log-probability
  after removing the top-k sources, ``lp(full) − lp(without top-k)``; **sufficiency**: the drop when
  only the top-k sources are kept, ``lp(full) − lp(only top-k)``; **AOPC**: their mean over k;
- **LDS** (linear datamodeling score, ContextCite, Cohen-Wang et al. 2024): the Spearman correlation,
  over random masks that keep each source with probability 1/2, between the detector's additive
  prediction (the sum of the kept sources' scores) and the actual log-probability.

A removed source is gone from every layer: no query sees its tokens, and every other token keeps its
position. A pass runs only the kept tokens at their original positions (compaction, equal to key
masking, which models without ``position_ids`` get instead: :mod:`probe.faithfulness.compaction`), from the
reused KV cache of the unmasked prefix before its first removed token (exact; tested against
uncached, key-masked passes). The gold answer's log-probability is the sum over its teacher-forced
tokens, ``Σ_t log P(x_t | x_<t)``; ``correct`` says whether every answer token is the greedy choice.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from probe import journal
from probe.checks import cache_keyword, check_input_ids, check_sample_fits, hf_model
from probe.errors import InvalidValueError
from probe.faithfulness.compaction import (
    check_before_answer,
    compacted_pass,
    compaction_supported,
    masked_pass,
    removed_positions,
)
from probe.faithfulness.masks import (
    KS,  # noqa: F401 (faithfulness.KS: the default ks)
    additive_ceiling,
    additive_ceiling_masks,
    lds,
    random_masks,
    top_k_masks,
)
from probe.faithfulness.settings import Judgement, Passes
from probe.journal import mask_bits
from probe.target import CHECKED, target_value, vocabulary_size
from probe.tasks import Sample, Source

REDUCTIONS = ("sum", "mean", "max")


class AnswerScores(NamedTuple):
    """The gold answer under each mask: ``logprob`` Tensor[masks] (sum over answer tokens) and
    ``correct`` BoolTensor[masks] (every answer token is the greedy choice)."""

    logprob: torch.Tensor
    correct: torch.Tensor


class Ablations(NamedTuple):
    """Masked passes already run on one sample: ``removed`` BoolTensor[masks, sources] (True =
    removed) and the gold answer under each, ``scores`` (:func:`answer_scores`)."""

    removed: torch.Tensor
    scores: AnswerScores

    @classmethod
    def of(cls, detection) -> Ablations | None:
        """The passes an ablation detection ran (``details["ablated"]``, e.g. ``leave_one_out``'s),
        ``None`` for a detection without them."""
        details = detection.details
        if "ablated" not in details:
            return None
        return cls(details["ablated"], AnswerScores(details["ablated_logprob"], details["ablated_correct"]))

    def to_frame(self, sample: Sample) -> pd.DataFrame:
        """One row per mask, to save beside a study: ``sample`` (a digest of the sample's tokens and
        sources, :func:`sample_digest`), ``removed`` (a string of ``0``/``1``, one per source),
        ``logprob``, ``correct``."""
        removed = [mask_bits(mask) for mask in self.removed]
        logprob, correct = self.scores
        return pd.DataFrame(
            {
                "sample": sample_digest(sample),
                "removed": removed,
                "logprob": logprob.tolist(),
                "correct": correct.tolist(),
            }
        )

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, sample: Sample | None = None) -> Ablations:
        """The rows of a :meth:`to_frame` table (of any number of samples) run on ``sample``; none when
        the table holds no pass of it. Pass them as ``known`` to :func:`evaluate` with the model they
        were run with. Without ``sample``: every row, which must all be one sample's."""
        if sample is None:
            if frame["sample"].nunique() > 1:
                raise InvalidValueError(
                    f"the table holds passes of {frame['sample'].nunique()} samples: pass the sample to take"
                )
            rows, n_sources = frame, len(frame.removed.iloc[0]) if len(frame) else 0
        else:
            rows, n_sources = frame[frame["sample"] == sample_digest(sample)], len(sample.sources)
        removed = torch.tensor([[bit == "1" for bit in mask] for mask in rows.removed], dtype=torch.bool)
        return cls(
            removed.reshape(len(rows), n_sources),
            AnswerScores(
                torch.tensor(rows.logprob.to_numpy(), dtype=torch.float),
                torch.tensor(rows.correct.to_numpy(bool)),
            ),
        )

    def logprob_of(self, kept: torch.Tensor) -> torch.Tensor:
        """Tensor[masks]: the saved log P(answer) of each mask of ``kept`` BoolTensor[masks, sources]
        (True = kept); refused for a mask that was not run."""
        saved = dict(zip(map(tuple, self.removed.tolist()), self.scores.logprob.tolist(), strict=True))
        wanted = [tuple((~mask).tolist()) for mask in kept]
        missing = sum(key not in saved for key in wanted)
        if missing:
            raise InvalidValueError(
                f"{missing} of {len(wanted)} masks were not run: run them, or ask for saved ones"
            )
        return torch.tensor([saved[key] for key in wanted])

    def leave_one_out(self) -> torch.Tensor:
        """Tensor[sources]: the drop of log P(answer) when each source alone is removed, from the saved
        full pass and single removals (exhaustive leave-one-out's scores); refused if one was not run."""
        n = self.removed.shape[1]
        full = self.logprob_of(torch.ones(1, n, dtype=torch.bool))
        return full - self.logprob_of(~single_removals(range(n), n))


def sample_digest(sample: Sample) -> str:
    """A short hash of a sample's token ids, source spans and target: equal only for the same sample."""
    digest = hashlib.sha1(sample.input_ids.numpy().astype(np.int64).tobytes())
    digest.update(repr([(s.start, s.end) for s in sample.sources]).encode())
    digest.update(sample.target_positions.numpy().astype(np.int64).tobytes())
    return digest.hexdigest()[:16]


def source_scores(
    token_scores: torch.Tensor, sources: Sequence[Source], reduce: str = "mean"
) -> torch.Tensor:
    """One score per source from one score per token: Tensor[sources].

    ``reduce``: ``"mean"`` over the source's tokens (the default: a sum favours long sentences),
    ``"sum"`` or ``"max"``.
    """
    if reduce not in REDUCTIONS:
        raise InvalidValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if not sources:
        raise InvalidValueError("the sample has no sources to score")
    scores = token_scores.detach().float().cpu()
    return torch.stack([getattr(scores[source.start : source.end], reduce)() for source in sources])


@torch.no_grad()
def answer_scores(
    model,
    sample: Sample,
    removed: torch.Tensor,
    how: Passes = Passes(),
) -> AnswerScores:
    """The gold answer's log-probability (``how.target``: another number about it, see
    :mod:`probe.target`) with the sources flagged in ``removed`` removed; ``how`` (:class:`Passes`): how
    the passes run.

    ``removed``: BoolTensor[masks, sources] (True = removed), over ``sample.sources``, which must lie
    before the answer. With ``reuse_prefix`` the unmasked prefix is run once, in order of each pass's
    first removed token, and each pass starts from a copy of its KV cache; otherwise every pass runs
    from the first token. ``compact`` (default: :func:`compaction_supported`): a pass runs only the
    kept tokens, at their original positions, every mask measured in original positions (equal to key
    masking, cheaper by the share removed); else the removed tokens stay in and are key-masked.
    ``batch_size`` masks run in one forward (compacted rows of unequal length are filled up with
    removed tokens, key-masked): faster on a GPU; on a CPU batch 1 is as fast. Within a
    :class:`probe.journal.Journal` the masks it holds are read, not run, and those run are written to it.
    """
    sources = sample.sources
    given = torch.as_tensor(removed)
    if given.dtype != torch.bool and not ((given == 0) | (given == 1)).all():
        raise InvalidValueError(
            "removed must be a BoolTensor[masks, sources] (True = removed), got values other than 0 and 1 "
            "(source indices?): build it with torch.zeros(masks, len(sample.sources), dtype=torch.bool) "
            "and set the removed sources True"
        )
    removed = given.bool()
    if removed.ndim != 2 or removed.shape[1] != len(sources):
        raise InvalidValueError(
            f"removed must be a BoolTensor[masks, {len(sources)}] over the sample's sources, "
            f"got shape {tuple(removed.shape)}"
        )
    reuse_prefix, batch_size, compact, target = how.reuse_prefix, how.batch_size, how.compact, how.target
    if batch_size < 1:
        raise InvalidValueError(f"batch_size must be at least 1, got {batch_size}")
    inner = hf_model(model)
    compact = compaction_supported(inner) if compact is None else compact
    check_sample_fits(inner, sample)
    ids = check_input_ids(inner, sample.input_ids)
    targets = sample.target_positions.to(ids.device)
    rows, gold = targets - 1, ids[0, targets]
    if isinstance(target, CHECKED):  # before any model work
        target.check(gold.cpu(), vocabulary_size(inner))
    hidden = torch.zeros(len(removed), ids.shape[1], dtype=torch.bool)
    for index, mask in enumerate(removed):
        hidden[index, removed_positions(sources, mask)] = True
    check_before_answer(hidden, int(rows[0]))
    starts = [int(h.nonzero()[0]) if h.any() else int(rows[0]) for h in hidden]
    starts = [min(start, int(rows[0])) if reuse_prefix else 0 for start in starts]
    logprob = torch.empty(len(removed))
    correct = torch.empty(len(removed), dtype=torch.bool)
    journaled, key, held = journal.active(), "", {}
    if journaled is not None:  # what a pass depends on besides its mask and the model
        key = f"{sample_digest(sample)}|{target!r}|{'compaction' if compact else 'key masking'}"
        held = journaled.read_passes(key, removed)
    for index, (value, right) in held.items():
        logprob[index], correct[index] = value, right
    order = sorted((i for i in range(len(removed)) if i not in held), key=starts.__getitem__)
    cache, done, keyword = None, 0, cache_keyword(inner)
    for batch in (order[i : i + batch_size] for i in range(0, len(order), batch_size)):
        first = starts[batch[0]]
        if first > done:  # extend the unmasked prefix cache up to this batch's first removed token
            # (only its cache is read: one row of logits, not [first - done, vocab], 17 GB at 16K on Gemma 3)
            prefix = inner(input_ids=ids[:, done:first], use_cache=True, logits_to_keep=1, **{keyword: cache})
            cache, done = prefix[keyword], first
        past = None
        if first:
            past = copy.deepcopy(cache)
            past.batch_repeat_interleave(len(batch))
        run = compacted_pass if compact else masked_pass
        logits = run(inner, ids, hidden[batch], first, past, rows)  # [batch, answer, vocab]
        logprob[batch] = torch.stack([target_value(target, one, gold) for one in logits]).cpu()
        correct[batch] = (logits.argmax(-1) == gold).all(-1).cpu()
        if journaled is not None:
            journaled.write_passes(key, removed[batch], logprob[batch], correct[batch])
    return AnswerScores(logprob, correct)


def single_removals(chosen: Sequence[int] | torch.Tensor, n_sources: int) -> torch.Tensor:
    """BoolTensor[m, n_sources] of removed sources: row i removes ``chosen[i]`` alone."""
    return torch.eye(n_sources, dtype=torch.bool)[torch.as_tensor(chosen, dtype=torch.long)]


def removal_drops(
    model, sample: Sample, removed: torch.Tensor, how: Passes = Passes()
) -> tuple[torch.Tensor, Ablations]:
    """The drop ``lp(full) − lp(without)`` of the gold answer's log-probability (or ``target``'s
    number) when the sources of each row of ``removed`` BoolTensor[groups, sources] are removed
    together, Tensor[groups]; and the passes that measured it (:class:`Ablations`, row 0 the full
    context, row 1 + g without group g). One :func:`answer_scores` call; ``how``: its options."""
    rows = torch.cat([torch.zeros(1, removed.shape[1], dtype=torch.bool), removed])
    ran = answer_scores(model, sample, rows, how)
    return ran.logprob[0] - ran.logprob[1:], Ablations(rows, ran)


def leave_one_out_drops(
    model, sample: Sample, chosen: Sequence[int] | torch.Tensor, how: Passes = Passes()
) -> tuple[torch.Tensor, Ablations]:
    """Leave-one-out on the ``chosen`` sources (indices, m of them): :func:`removal_drops` of each
    alone, Tensor[m], and its passes (row 1 + i without ``chosen[i]``)."""
    return removal_drops(model, sample, single_removals(chosen, len(sample.sources)), how)


def _known_or_run(
    removed: torch.Tensor,
    known: Sequence[Ablations],
    run: Callable[[torch.Tensor], AnswerScores],
    record: list[Ablations] | None,
) -> AnswerScores:
    """The answer scores of each mask of ``removed`` (BoolTensor[masks, sources]): from ``known`` where
    it holds the mask, else from ``run`` over the rest (appended to ``record`` unless it is None)."""
    found = {}
    for ablations in known:
        if ablations.removed.shape[1:] != removed.shape[1:]:
            raise InvalidValueError(
                f"known ablations are over {ablations.removed.shape[1]} sources, this sample has "
                f"{removed.shape[1]}: pass only passes run on this sample"
            )
        for mask, logprob, correct in zip(ablations.removed, *ablations.scores, strict=True):
            found[tuple(mask.tolist())] = (logprob, correct)
    keys = [tuple(mask.tolist()) for mask in removed]
    todo = [i for i, key in enumerate(keys) if key not in found]
    if todo:
        ran = run(removed[todo])
        if record is not None:
            record.append(Ablations(removed[todo], ran))
        found |= {keys[i]: pair for i, pair in zip(todo, zip(*ran, strict=True), strict=True)}
    logprob, correct = zip(*(found[key] for key in keys), strict=True)
    return AnswerScores(torch.stack(logprob).float(), torch.stack(correct))


def ground_truth_scores(sample: Sample) -> torch.Tensor:
    """Tensor[sources]: 1 for supporting sources, 0 otherwise (the planted facts as a detector)."""
    return torch.tensor([float(source.category == "supporting") for source in sample.sources])


def reference_scores(sample: Sample) -> dict[str, torch.Tensor]:
    """The two reference scorers every comparison carries, each Tensor[sources]: ``ground_truth``
    (:func:`ground_truth_scores`) and ``random_sources`` (uniform, seeded by the sample's seed, on
    numpy's stream, apart from torch's stream of the masks)."""
    random = np.random.default_rng(sample.seed).random(len(sample.sources))
    random_sources = torch.tensor(random, dtype=torch.float32)
    return {"ground_truth": ground_truth_scores(sample), "random_sources": random_sources}


def evaluate(
    model,
    sample: Sample,
    scores: Mapping[str, torch.Tensor],
    judgement: Judgement = Judgement(),
    how: Passes = Passes(),
    known: Sequence[Ablations] = (),
    record: list[Ablations] | None = None,
) -> pd.DataFrame:
    """Faithfulness of several source scorings of one sample, one row per scorer.

    ``scores``: name → Tensor[sources] (see :func:`source_scores`). Every scorer is judged on the
    same ablations (:class:`Judgement`): removing / keeping its top-k sources for k in ``judgement.ks``
    and ``judgement.n_masks`` random masks (each source kept with probability ``keep``, seeded) for LDS.
    Identical masks run once, as :func:`answer_scores` runs them (``how``: :class:`Passes`); masks
    in ``known`` (passes already run with the same model, ablation and target, e.g. a ``leave_one_out``
    detection's, :meth:`Ablations.of`, or a saved study's, :meth:`Ablations.from_frame`) are not run
    again; the passes that do run are appended to ``record`` (a list) when one is given.

    ``judgement.ceiling_masks`` > 0 adds the reference scorer ``additive_ceiling``: :func:`additive_ceiling`
    fit on that many further random masks (seeded apart; none of them an LDS mask), judged like every
    scorer; each row's ``lds_share`` is then its LDS over the ceiling's.
    Columns: ``scorer``, ``full_logprob``, ``full_correct``, ``comprehensiveness_k{k}``,
    ``sufficiency_k{k}``, ``correct_removed_k{k}``, ``correct_kept_k{k}``, ``aopc_comprehensiveness``,
    ``aopc_sufficiency``, ``lds``, ``n_sources`` (and ``lds_share`` with a ceiling).
    """
    n_sources, ks, ceiling_masks = len(sample.sources), judgement.ks, judgement.ceiling_masks
    if record is not None and not isinstance(record, list):
        raise InvalidValueError(
            f"record must be a list (the passes run are appended to it), got {type(record).__name__}"
        )
    kept_random = random_masks(n_sources, judgement.n_masks, judgement.keep, judgement.seed)
    fit = additive_ceiling_masks(kept_random, ceiling_masks, judgement.keep, judgement.seed)
    if ceiling_masks and len(fit) < 2:
        raise InvalidValueError(
            f"the additive ceiling is a fit on several masks: ceiling_masks={ceiling_masks} leaves "
            f"{len(fit)} mask(s) apart from the LDS masks; give 0 (no ceiling) or more (the studies use 256)"
        )
    if how.compact is None:
        how = replace(how, compact=compaction_supported(model))
    run = functools.partial(answer_scores, model, sample, how=how)
    if ceiling_masks:
        ceiling = additive_ceiling(fit, _known_or_run(~fit, known, run, record).logprob)
        scores = {**scores, "additive_ceiling": ceiling}
    masks = {"full": torch.zeros(1, n_sources, dtype=torch.bool), "random": ~kept_random}
    for name, score in scores.items():
        if not torch.is_tensor(score) or score.shape != (n_sources,):
            shape = tuple(score.shape) if torch.is_tensor(score) else type(score).__name__
            raise InvalidValueError(
                f"scores[{name!r}] must be a Tensor with one value per source ({n_sources}), got {shape}"
            )
        if not torch.isfinite(score).all():
            bad = [sample.sources[i] for i in (~torch.isfinite(score)).nonzero()[:3, 0].tolist()]
            raise InvalidValueError(
                f"scores[{name!r}] holds NaN or infinite values (e.g. at sources {bad}): a ranking of them "
                "means nothing; fix the scorer or drop it"
            )
        top = top_k_masks(score, ks)
        masks[f"{name}/removed"] = top
        masks[f"{name}/kept"] = ~top
    unique, where = torch.cat(list(masks.values())).unique(dim=0, return_inverse=True)
    results = _known_or_run(unique, known, run, record)
    bounds = np.cumsum([0] + [len(m) for m in masks.values()])
    lookup = {
        key: AnswerScores(results.logprob[where[a:b]], results.correct[where[a:b]])
        for key, a, b in zip(masks, bounds[:-1], bounds[1:], strict=True)
    }
    full = lookup["full"]
    rows = []
    for name, score in scores.items():
        removed, kept = lookup[f"{name}/removed"], lookup[f"{name}/kept"]
        row = {"scorer": name, "full_logprob": float(full.logprob[0]), "full_correct": bool(full.correct[0])}
        for i, k in enumerate(ks):
            row[f"comprehensiveness_k{k}"] = float(full.logprob[0] - removed.logprob[i])
            row[f"sufficiency_k{k}"] = float(full.logprob[0] - kept.logprob[i])
            row[f"correct_removed_k{k}"] = bool(removed.correct[i])
            row[f"correct_kept_k{k}"] = bool(kept.correct[i])
        row["aopc_comprehensiveness"] = float(np.mean([row[f"comprehensiveness_k{k}"] for k in ks]))
        row["aopc_sufficiency"] = float(np.mean([row[f"sufficiency_k{k}"] for k in ks]))
        row["lds"] = lds(score, kept_random, lookup["random"].logprob)
        row["n_sources"] = n_sources
        rows.append(row)
    frame = pd.DataFrame(rows)
    if ceiling_masks:
        frame["lds_share"] = frame.lds / frame.lds[frame.scorer == "additive_ceiling"].iloc[0]
    frame.attrs = dict(
        ceiling_masks=ceiling_masks,
        ks=list(ks),
        n_masks=judgement.n_masks,
        keep=judgement.keep,
        seed=judgement.seed,
        reuse_prefix=how.reuse_prefix,
        batch_size=how.batch_size,
        ablation="compaction" if how.compact else "key_masking",
    )
    return frame
