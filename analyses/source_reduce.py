"""Token scores to source scores: mean, sum or max over a source's tokens, judged by exact ablation.

Prompted by the peers' run (issue 37, item 4): inseq's ``saliency`` ranks sources by the **sum** of
its per-token gradient norms and reached a higher LDS than longprobe's ``embedding_grad``, whose
token scores longprobe reduces by the **mean** (``faithfulness.source_scores``' default) — the same
gradient norm up to a per-answer-token normalisation (``analyses/peers/inseq/NOTES.md``). Is the
reduction what separates them, and does the default hold for every token-level detector? Judged
outside the held-out study (its samples prompted the question): new seeds (20000 on), one thread.

Per sample: the token-level detectors (those without source scores of their own; from one shared
pass), each reduced three ways, all judged on the same 32 random half masks (LDS) and top-k masks
(k = 1, 4: comprehensiveness, sufficiency) by :func:`probe.faithfulness.evaluate`. Per detector:
each reduction's mean LDS and its paired difference from the mean reduction, 95 % bootstrap
intervals over samples.

    python -m analyses.source_reduce --tasks multihop-2 document-2 --seeds 20000 20001 ... --csv out.csv
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from bench.harness import new_seed_samples, report
from probe import faithfulness, tasks
from probe.detectors import detect_many
from probe.stats import bootstrap

TOKEN_LEVEL = ("attention", "information_flow", "embedding_grad", "fr")
KS = (1, 4)
METRICS = ("lds", "aopc_comprehensiveness", "aopc_sufficiency")
MASKS = 32


def reduced_scores(token_scores: dict[str, torch.Tensor], sample: tasks.Sample) -> dict[str, torch.Tensor]:
    """``"name/reduction"`` → Tensor[sources] for every token scoring (name → Tensor[seq]) and
    reduction."""
    return {
        f"{name}/{reduce}": faithfulness.source_scores(scores, sample.sources, reduce)
        for name, scores in token_scores.items()
        for reduce in faithfulness.REDUCTIONS
    }


def paired(table: pd.DataFrame, against: tuple[str, str] | None = None) -> pd.DataFrame:
    """Per detector, metric (those of :data:`METRICS` in ``table``) and reduction: the mean over samples
    [95 % CI] and the paired difference [95 % CI] from the ``against`` (detector, reduction) column — by
    default each detector's own mean reduction (column ``baseline`` names it)."""
    rows = []
    for metric in (metric for metric in METRICS if metric in table):
        wide = table.pivot_table(index=["task", "seed"], columns=["detector", "reduce"], values=metric)
        for detector, reduce in wide.columns:
            baseline = against or (detector, "mean")
            values = wide[(detector, reduce)]
            own = bootstrap(values.dropna().to_numpy())
            gap = bootstrap((values - wide[baseline]).dropna().to_numpy())
            rows.append({"detector": detector, "reduce": reduce, "metric": metric, "value": own.value,
                         "low": own.low, "high": own.high, "baseline": "/".join(baseline),
                         "minus_baseline": gap.value, "minus_baseline_low": gap.low,
                         "minus_baseline_high": gap.high, "samples": own.n})  # fmt: skip
    return pd.DataFrame(rows)


def judged(
    model, task: str, seed: int, sample: tasks.Sample, token_scores: dict[str, torch.Tensor]
) -> pd.DataFrame:
    """Every token scoring (name → Tensor[seq]) reduced three ways and judged on the same ablations:
    one row per (detector, reduction)."""
    return judged_sources(model, task, seed, sample, reduced_scores(token_scores, sample))


def judged_sources(
    model, task: str, seed: int, sample: tasks.Sample, source_scores: dict[str, torch.Tensor]
) -> pd.DataFrame:
    """Source scorings (``"detector/reduction"`` → Tensor[sources]) judged on the same 32 random half
    masks and top-k masks: one row per scoring."""
    frame = faithfulness.evaluate(
        model, sample, source_scores, faithfulness.Judgement(ks=KS, n_masks=MASKS, seed=seed)
    )
    detector, reduce = frame.scorer.str.split("/", expand=True).T.values
    frame = frame.assign(task=task, seed=seed, detector=detector, reduce=reduce)
    lds = frame.set_index("scorer").lds
    print(task, seed, {name: round(float(value), 2) for name, value in lds.items()}, flush=True)
    return frame[["task", "seed", "detector", "reduce", "lds", "aopc_comprehensiveness",
                  "aopc_sufficiency", "n_sources", "full_correct"]]  # fmt: skip


def summarised(
    rows: list[pd.DataFrame], csv: Path | None, against: tuple[str, str] | None = None
) -> pd.DataFrame:
    """The per-sample table (written to ``csv``) and its :func:`paired` summary (``*_summary.csv``)."""
    table = pd.concat(rows, ignore_index=True)
    summary = paired(table, against)
    print(summary[summary.metric == "lds"].round(3).to_string(index=False))
    report(summary, csv.with_name(csv.stem + "_summary.csv") if csv else None)
    return report(table, csv)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args, model, tokenizer, samples = new_seed_samples(__doc__, argv)
    rows = []
    for task, seed, sample in samples:
        found = detect_many(list(TOKEN_LEVEL), model, tokenizer, sample)
        rows.append(judged(model, task, seed, sample, {name: found[name].scores for name in TOKEN_LEVEL}))
    return summarised(rows, args.csv)


if __name__ == "__main__":
    main()
