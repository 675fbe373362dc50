"""Detectors judged on the same samples: plausibility, faithfulness and the tables that set them side by side.

The library behind ``python -m analyses.detector_compare`` (which adds the figures and the command
line): :func:`compare_samples` runs every detector on a batch of samples and judges it two ways,
plausibility (:func:`probe.metrics.plausibility`) and faithfulness (:func:`judge_faithfulness`);
:func:`rank_table`, :func:`faithfulness_intervals` and :func:`ranks_markdown` summarise the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from probe import answer, detectors, faithfulness, given_answer, metrics, stats, tasks

# one forward+backward a sample
SHARED_PASS = tuple(name for name in detectors.names() if detectors.shared_pass(name))
ONE_PASS = (*SHARED_PASS, "key_removal_banzhaf", "attn_lrp")
# the main job's: the critical-token detectors of the papers (CDT's attention, gradient and information
# flow; LongPPL's LSD), the key-removal gradients and the ablation reference (leave_one_out, pruned on
# key_removal_grad's ranking); the full 1K study in RESULTS.md judges every detector
DEFAULT_DETECTORS = [
    "attention",
    "information_flow",
    "embedding_grad",
    "lsd",
    "key_removal_grad",
    "key_removal_banzhaf",
    "leave_one_out",
]
LOO_RANKER = detectors.option_default("leave_one_out", "rank_by")  # pruned leave-one-out's ranking
REFERENCES = ("ground_truth", "random_sources", "additive_ceiling")
BASELINES = ("attention", "leave_one_out")  # every scorer's difference from these, with intervals
INTERVAL_METRICS = ("aopc_comprehensiveness", "aopc_sufficiency", "lds")
LAYER_CATEGORIES = ("supporting", "interference", "noise", "low_frequency", "other")
RANKED = {"auroc": "plausibility", "aopc_comprehensiveness": "comprehensiveness", "lds": "LDS"}
ANSWERS = {"correct": "answered correctly", "wrong": "answered wrongly", "all": "all answers"}
#: What the detectors explain: the gold answer, or the model's own greedy answer, teacher-forced
EXPLAINED = ("gold", "own")
#: The columns of a sample's greedy answer, in every row (``explained``: which answer the row explains)
ANSWER_COLUMNS = ("generated", "given", "correct", "exact_match", "f1", "explained")


def layer_enrichment(per_layer: torch.Tensor, sample: tasks.Sample) -> pd.DataFrame:
    """Per layer and category: mean score per token of the category / mean score per context token.

    ``per_layer`` is [layers, seq]. 1 means a category gets its size's worth of the measure;
    noise covers most of the context, so raw shares would mostly show category sizes.
    """
    context = sample.prompt_length
    frame = pd.DataFrame(per_layer[:, :context].T.numpy())
    labels = sample.categories[:context]
    frame["category"] = [label if label in LAYER_CATEGORIES else "other" for label in labels]
    enrichment = frame.groupby("category").mean() / frame.drop(columns="category").mean()
    enrichment = enrichment.reindex(LAYER_CATEGORIES).dropna()
    return (
        enrichment.rename_axis("category")
        .reset_index()
        .melt("category", var_name="layer", value_name="enrichment")
    )


def source_scorers(
    found: dict[str, detectors.Detection], sample: tasks.Sample, reduce: str = "mean"
) -> dict[str, torch.Tensor]:
    """Scorer name → Tensor[sources]: every detection's source scores, then the two references.

    :meth:`probe.detectors.Detection.source_scores`: a detector's own source scores (ablation and
    additive detectors), else ``reduce`` over each source's tokens.
    The references: :func:`probe.faithfulness.reference_scores`.
    """
    scores = {name: detection.source_scores(sample, reduce) for name, detection in found.items()}
    return scores | faithfulness.reference_scores(sample)


def compare_samples(
    model,
    tokenizer,
    samples: list[tasks.Sample],
    names: list[str],
    top_k: int,
    answers: Sequence[dict],
    options: dict[str, dict] | None = None,
    source_reduce: str = "mean",
    judgement: faithfulness.Judgement = faithfulness.Judgement(),
    how: faithfulness.Passes = faithfulness.Passes(),
    pages: Path | None = None,
    ablations: list[pd.DataFrame] | None = None,
    saved: pd.DataFrame | None = None,
) -> tuple[list[dict], list[pd.DataFrame], pd.DataFrame]:
    """Plausibility rows, per-layer rows and faithfulness rows of the detectors ``names`` on ``samples``.

    ``samples`` are the samples as explained (their teacher-forced answer is what the detectors explain)
    and ``answers`` each one's greedy answer (:func:`explained`), written into its rows.

    ``options[name]`` go to detector ``name``; the attention family of all ``samples`` comes from one
    batched pass (:func:`probe.detectors.detect_many`); faithfulness as :func:`judge_faithfulness` judges
    it (``judgement``: what it measures, the ``additive_ceiling`` reference included when
    ``judgement.ceiling_masks`` is positive; ``how``: how its masked passes run, e.g. ``how.batch_size``
    a forward). Each row carries the detector's cost on its sample:
    ``seconds`` (the shared pass's time for the detectors read off it) and ``passes`` (forward or
    forward+backward passes: 1 for a one-pass detector, 0 for a model-free one, the ablation
    detectors' own count). ``pages``: write each detector's token view of the first sample there
    (``{pages}_{name}.html``). ``ablations``: a list that each sample's masked passes are appended to
    (:meth:`probe.faithfulness.Ablations.to_frame` with ``task`` and ``seed``), so that a later judge
    of other scores on the same samples (``analyses/peers/compare.py``) need not run them again.
    ``saved``: masked passes another run saved with the same model (``to_frame`` rows, e.g.
    :func:`analyses.study_files.saved_passes`): a mask it holds for a sample is read, not run, and
    not appended to ``ablations`` again.
    """
    rows, layers, faithful = [], [], []
    found_all = detectors.detect_many(names, model, tokenizer, samples, options)
    for name, detection in found_all[0].items() if pages is not None else ():
        detection.save_html(pages.with_name(f"{pages.name}_{name}.html"))
    for sample, found, greedy in zip(samples, found_all, answers, strict=True):
        about = {"task": sample.task, "seed": sample.seed, **greedy}
        for name, detection in found.items():
            rows.append(
                {
                    "detector": name,
                    **about,
                    **metrics.plausibility(detection, sample, top_k),
                    **metrics.source_plausibility(detection.source_scores(sample, source_reduce), sample),
                    **_diagnostics(detection),
                    "seconds": detection.seconds,
                    "passes": detection.details.get("passes", int(name in ONE_PASS)),
                }
            )
            if name in ("attention", "information_flow"):
                layers.append(
                    layer_enrichment(detection.details["per_layer"], sample).assign(measure=name, **about)
                )
        passes = [] if ablations is not None else None
        read = [] if saved is None else [faithfulness.Ablations.from_frame(saved, sample)]
        judged = judge_faithfulness(model, sample, found, source_reduce, judgement, how, passes, read)
        if passes:
            frames = [one.to_frame(sample) for one in passes]
            ablations.append(pd.concat(frames, ignore_index=True).assign(task=sample.task, seed=sample.seed))
        judged["seconds"] = judged.scorer.map({name: detection.seconds for name, detection in found.items()})
        faithful.append(judged.assign(**about))
    return rows, layers, pd.concat(faithful, ignore_index=True)


def greedy_answer(model, tokenizer, sample: tasks.Sample, max_new_tokens: int | None) -> dict:
    """The model's greedy reply to ``sample`` (:func:`probe.answer`; ``max_new_tokens`` None: its default),
    the answer it gives in it (:func:`probe.given_answer`) and how that answer scores against the gold
    one: ``correct`` (the task's own check, :meth:`~probe.tasks.Sample.score`), ``exact_match`` and ``f1``
    (SQuAD's normalization, :meth:`~probe.tasks.Sample.answer_match`)."""
    generated = answer(model, tokenizer, sample, max_new_tokens)
    given = given_answer(sample, generated)
    return {
        "generated": generated,
        "given": given,
        "correct": bool(sample.score(given)),
        **sample.answer_match(given),
    }


def explained(
    model, tokenizer, sample: tasks.Sample, explain: str | None, max_new_tokens: int | None = None
) -> tuple[tasks.Sample, dict]:
    """The sample whose answer the detectors explain and its greedy answer (:func:`greedy_answer`).

    ``explain``: ``"gold"`` (``sample`` as it is), ``"own"`` (the answer the model gives, teacher-forced:
    :meth:`~probe.tasks.Sample.with_answer`) or None: ``"own"`` for a real question (``sample.scoring ==
    "exact_match"``), else ``"gold"``. A model that gives no answer at all leaves the gold one explained;
    the ``explained`` column says which answer each row explains."""
    if explain is None:
        explain = "own" if sample.scoring == "exact_match" else "gold"
    greedy = greedy_answer(model, tokenizer, sample, max_new_tokens)
    if explain == "own" and greedy["given"]:
        return sample.with_answer(greedy["given"], tokenizer), greedy | {"explained": "own"}
    return sample, greedy | {"explained": "gold"}


def judge_faithfulness(
    model,
    sample: tasks.Sample,
    found: dict[str, detectors.Detection],
    source_reduce: str = "mean",
    judgement: faithfulness.Judgement = faithfulness.Judgement(),
    how: faithfulness.Passes = faithfulness.Passes(),
    record: list[faithfulness.Ablations] | None = None,
    saved: Sequence[faithfulness.Ablations] = (),
) -> pd.DataFrame:
    """:func:`probe.faithfulness.evaluate` of :func:`source_scorers` on one sample (``judgement``: what it
    measures, ``how``: how its passes run), one row per scorer: ``kind`` (detector / reference),
    ``source_reduce``, ``n_masks`` (``judgement.n_masks``, random masks seeded by ``judgement.seed``),
    ``ablation`` (compaction or key masking). The masks an ablation detector already ran for the same
    target (the default) are not run again, nor those of ``saved`` (passes run before on this sample).
    ``record``: a list that every pass of the judgement is appended to, the ablation detectors' and those
    run here (not ``saved``'s)."""
    scorers = source_scorers(found, sample, source_reduce)
    known = [
        ablations
        for detection in found.values()
        if how.target is None  # a detection's passes explain the default target
        and "target" not in detection.settings
        and (ablations := faithfulness.Ablations.of(detection))
    ]
    if record is not None:
        record.extend(known)
    faithful = faithfulness.evaluate(model, sample, scorers, judgement, how, [*known, *saved], record)
    faithful.insert(1, "kind", np.where(faithful.scorer.isin(REFERENCES), "reference", "detector"))
    return faithful.assign(
        source_reduce=source_reduce, n_masks=judgement.n_masks, ablation=faithful.attrs["ablation"]
    )


def _diagnostics(detection: detectors.Detection) -> dict:
    """A detection's scalar diagnostics (its float ``details``), for its plausibility row."""
    return {key: value for key, value in detection.details.items() if isinstance(value, float)}


def answer_label(correct: pd.Series) -> pd.Series:
    """``correct`` / ``wrong`` for each sample's bool ``correct``."""
    return correct.map({True: "correct", False: "wrong"})


def deletion_curves(faithful: pd.DataFrame) -> pd.DataFrame:
    """Long form of the comprehensiveness columns: one row per sample, scorer and k (``drop`` in nats)."""
    ks = [int(c.removeprefix("comprehensiveness_k")) for c in faithful if c.startswith("comprehensiveness_k")]
    curves = faithful.melt(
        id_vars=["task", "seed", "scorer", "kind", "correct"],
        value_vars=[f"comprehensiveness_k{k}" for k in ks],
        var_name="k",
        value_name="drop",
    )
    curves["k"] = curves.k.str.removeprefix("comprehensiveness_k").astype(int)
    return curves.assign(answer=answer_label(curves.correct))


def _by_answer(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` once per answer group: correct, wrong, and all samples (column ``answer``)."""
    labelled = frame.assign(answer=answer_label(frame.correct))
    return pd.concat([labelled, frame.assign(answer="all")], ignore_index=True)


def rank_table(table: pd.DataFrame, faithful: pd.DataFrame) -> pd.DataFrame:
    """Per answer group and detector: mean AUROC, AOPC of comprehensiveness and LDS, each with its
    rank among the detectors (1 = best; NaN means rank last), the mean seconds a sample, and the
    number of samples."""
    plausible = _by_answer(table).groupby(["answer", "detector"]).auroc.mean()
    detectors_only = faithful[faithful.kind == "detector"].rename(columns={"scorer": "detector"})
    grouped = _by_answer(detectors_only).groupby(["answer", "detector"])
    causal = grouped[
        ["comprehensiveness_k1", "aopc_comprehensiveness", "aopc_sufficiency", "lds", "seconds"]
    ].mean()
    ranks = causal.join(plausible).join(grouped.seed.size().rename("samples")).reset_index()
    for column, name in RANKED.items():
        ranks[f"rank_{name}"] = (
            ranks.groupby("answer")[column]
            .rank(ascending=False, method="min", na_option="bottom")
            .astype(int)
        )
    ranks["answer"] = pd.Categorical(ranks.answer, list(ANSWERS))
    return ranks.sort_values(["answer", "rank_plausibility"]).reset_index(drop=True)


def ranks_markdown(ranks: pd.DataFrame, intervals: pd.DataFrame) -> str:
    """The rank table as GitHub markdown, one table per answer group, with the 95 % bootstrap
    intervals of AOPC and LDS (``intervals``: :func:`faithfulness_intervals`) and the cost."""
    header = (
        "| detector | AUROC | rank | comp. k=1 (nats) | AOPC comp. (nats) [95 % CI] | rank "
        "| LDS [95 % CI] | rank | s / sample |\n|---|---|---|---|---|---|---|---|---|"
    )
    own = intervals[intervals.versus == ""].set_index(["answer", "scorer", "metric"])

    def ci(group: str, detector: str, metric: str) -> str:
        row = own.loc[(group, detector, metric)]
        return stats.interval_text(row.value, row.low, row.high)

    parts = []
    for group, part in ranks.groupby("answer", observed=True):
        lines = [
            f"| `{r.detector}` | {r.auroc:.2f} | {r.rank_plausibility} | {r.comprehensiveness_k1:.2f} "
            f"| {ci(group, r.detector, 'aopc_comprehensiveness')} | {r.rank_comprehensiveness} "
            f"| {ci(group, r.detector, 'lds')} | {r.rank_LDS} | {r.seconds:.1f} |"
            for r in part.itertuples()
        ]
        n = int(part.samples.max())
        title = f"### {ANSWERS[group].capitalize()} ({n} sample{'s' * (n != 1)})"
        parts.append(f"{title}\n\n{header}\n" + "\n".join(lines))
    return "\n\n".join(parts) + "\n\nRank 1 = best (AUROC: plausibility; AOPC and LDS: faithfulness).\n"


# the held-out protocol's words for a paired interval that excludes 0 above / below it, per metric
VERDICT_WORDS = {
    "lds": ("above", "below"),
    "aopc_comprehensiveness": ("better", "worse"),  # more lost when the top k are removed
    "aopc_sufficiency": ("worse", "better"),  # more lost when only the top k are kept
}


def verdicts_markdown(faithful: pd.DataFrame, intervals: pd.DataFrame, versus: str = "leave_one_out") -> str:
    """Every scorer against ``versus``, over all samples, then over those answered correctly and wrongly
    apart (a table each, where the group has samples), as GitHub markdown (the held-out protocol,
    ``figures/studies/heldout_protocol.md``): its LDS [95 % CI], the paired difference of each of
    :data:`VERDICT_WORDS`' metrics from ``versus``'s with its interval and word ("matches" where the
    interval covers 0), its LDS share of the additive ceiling, and the share of samples whose gold
    answer the top 8 sources alone keep (``correct_kept_k8``). ``intervals``:
    :func:`faithfulness_intervals`. Sorted by LDS; reference rows in italics."""
    groups = _by_answer(faithful)
    tables = []
    for group in ("all", "correct", "wrong"):
        rows = groups[groups.answer == group]
        if not rows.empty:
            n = rows.drop_duplicates(["task", "seed"]).shape[0]
            table = _verdicts_table(rows, intervals[intervals.answer == group], versus)
            tables.append(f"### {ANSWERS[group].capitalize()} ({n} sample{'s' * (n != 1)})\n\n{table}")
    return "\n".join(tables)


def _verdicts_table(faithful: pd.DataFrame, intervals: pd.DataFrame, versus: str) -> str:
    """:func:`verdicts_markdown`'s table of one answer group (its rows and intervals)."""
    every = intervals.set_index(["scorer", "metric", "versus"])

    def interval(scorer: str, metric: str, against: str = "") -> str:
        if (scorer, metric, against) not in every.index:
            return "–"
        row = every.loc[(scorer, metric, against)]
        text = stats.interval_text(row.value, row.low, row.high)
        if not against:
            return text
        if np.isnan(row.low):  # too few samples for an interval: no verdict
            return f"{text}, no interval"
        above, below = VERDICT_WORDS[metric]
        return f"{text} {above if row.low > 0 else below if row.high < 0 else 'matches'}"

    columns = ["lds", "lds_share", "correct_kept_k8"]  # the last two only with a ceiling / with k = 8
    means = faithful.reindex(columns=["scorer", *columns]).astype({c: float for c in columns})
    means = means.groupby("scorer").mean().sort_values("lds", ascending=False)

    lines = [
        f"| scorer | LDS | LDS − `{versus}` | share of ceiling | AOPC comp. − `{versus}` "
        f"| AOPC suff. − `{versus}` | top 8 alone give the gold answer |",
        "|---|---|---|---|---|---|---|",
    ]
    for scorer, row in means.iterrows():
        name = f"*{scorer}*" if scorer in REFERENCES else f"`{scorer}`"
        against = [interval(scorer, metric, versus) for metric in VERDICT_WORDS]
        lines.append(
            f"| {name} | {interval(scorer, 'lds')} | {against[0]} | {stats.number_text(row.lds_share)} "
            f"| {against[1]} | {against[2]} | {stats.number_text(row.correct_kept_k8)} |"
        )
    return "\n".join(lines) + "\n"


def faithfulness_intervals(faithful: pd.DataFrame) -> pd.DataFrame:
    """Per answer group, scorer and metric (:data:`INTERVAL_METRICS`): the mean over samples with its
    95 % bootstrap interval (``versus`` empty), and the mean paired difference from each of
    :data:`BASELINES` that ran (``versus`` = its name), with its interval. NaN values (a constant
    scorer has no LDS) are left out; ``samples`` counts the rest."""
    rows = []
    grouped = _by_answer(faithful)
    for (group, scorer), part in grouped.groupby(["answer", "scorer"], sort=False):
        for metric in INTERVAL_METRICS:
            rows.append(_interval(part[metric], answer=group, scorer=scorer, metric=metric, versus=""))
    for metric in INTERVAL_METRICS:
        wide = grouped.pivot_table(
            index=["answer", "task", "seed"], columns="scorer", values=metric, dropna=False
        )
        for baseline in [b for b in BASELINES if b in wide]:
            for scorer in [s for s in wide if s != baseline]:
                for group, part in (wide[scorer] - wide[baseline]).groupby(level="answer", sort=False):
                    rows.append(_interval(part, answer=group, scorer=scorer, metric=metric, versus=baseline))
    return pd.DataFrame([row for row in rows if row is not None])


def _interval(values: pd.Series, **about) -> dict | None:
    """``about`` with the mean of ``values`` and its bootstrap interval; None when every value is NaN."""
    if values.isna().all():
        return None
    estimate = stats.bootstrap(values.to_numpy())
    return {
        **about,
        "value": estimate.value,
        "low": estimate.low,
        "high": estimate.high,
        "samples": estimate.n,
    }


def faithfulness_summary(faithful: pd.DataFrame) -> pd.DataFrame:
    """Mean comprehensiveness at k = 1, AOPC (comprehensiveness, sufficiency) and LDS per answer
    group and scorer, references included."""
    columns = ["comprehensiveness_k1", "aopc_comprehensiveness", "aopc_sufficiency", "lds"]
    return _by_answer(faithful).groupby(["answer", "scorer"], sort=False)[columns].mean().reset_index()
