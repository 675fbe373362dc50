"""Token scores to source scores: mean, sum or max over a source's tokens, judged by exact ablation.

Prompted by the peers' run (issue 37, item 4): inseq's ``saliency`` ranks sources by the **sum** of
its per-token gradient norms and reached a higher LDS than longprobe's ``embedding_grad``, whose
token scores longprobe reduces by the **mean** (``faithfulness.source_scores``' default) — the same
gradient norm up to a per-answer-token normalisation (``bench/peers/inseq/NOTES.md``). Is the
reduction what separates them, and does the default hold for every token-level detector? Judged
outside the held-out study (its samples prompted the question): new seeds (20000 on), one thread.

Per sample: the token-level detectors (those without source scores of their own; from one shared
pass), each reduced three ways, all judged on the same 32 random half masks (LDS) and top-k masks
(k = 1, 4: comprehensiveness, sufficiency) by :func:`probe.faithfulness.evaluate`. Per detector:
each reduction's mean LDS and its paired difference from the mean reduction, 95 % bootstrap
intervals over samples.

    python bench/source_reduce.py --tasks multihop-2 document-2 --seeds 20000 20001 ... --csv out.csv
"""

from __future__ import annotations

import pandas as pd
import torch
from harness import new_seed_samples, report

from probe import faithfulness, tasks
from probe.detectors import detect_many
from probe.stats import bootstrap

TOKEN_LEVEL = ("attention", "information_flow", "embedding_grad", "fr")
KS = (1, 4)
MASKS = 32


def reduced_scores(found: dict, sample: tasks.Sample) -> dict[str, torch.Tensor]:
    """``"detector/reduction"`` → Tensor[sources] for every detector in ``found`` and reduction."""
    scores = {}
    for name, detection in found.items():
        if "source_scores" in detection.details:
            raise ValueError(f"{name} has source scores of its own: no reduction applies to it")
        for reduce in faithfulness.REDUCTIONS:
            scores[f"{name}/{reduce}"] = faithfulness.source_scores(detection.scores, sample.sources, reduce)
    return scores


def paired(table: pd.DataFrame) -> pd.DataFrame:
    """Per detector, metric and reduction: the mean over samples [95 % CI] and, against the mean
    reduction, the paired difference [95 % CI]."""
    rows = []
    for metric in ("lds", "aopc_comprehensiveness", "aopc_sufficiency"):
        wide = table.pivot_table(index=["task", "seed"], columns=["detector", "reduce"], values=metric)
        for detector, reduce in wide.columns:
            values = wide[(detector, reduce)]
            own = bootstrap(values.dropna().to_numpy())
            gap = bootstrap((values - wide[(detector, "mean")]).dropna().to_numpy())
            rows.append({"detector": detector, "reduce": reduce, "metric": metric, "value": own.value,
                         "low": own.low, "high": own.high, "minus_mean": gap.value, "minus_mean_low": gap.low,
                         "minus_mean_high": gap.high, "samples": own.n})  # fmt: skip
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args, model, tokenizer, samples = new_seed_samples(__doc__, argv)
    rows = []
    for task, seed, sample in samples:
        found = detect_many(list(TOKEN_LEVEL), model, tokenizer, sample)
        frame = faithfulness.evaluate(
            model, sample, reduced_scores(found, sample), ks=KS, n_masks=MASKS, seed=seed
        )
        detector, reduce = frame.scorer.str.split("/", expand=True).T.values
        frame = frame.assign(task=task, seed=seed, detector=detector, reduce=reduce)
        rows.append(frame[["task", "seed", "detector", "reduce", "lds", "aopc_comprehensiveness",
                           "aopc_sufficiency", "n_sources", "full_correct"]])  # fmt: skip
        lds = frame.set_index("scorer").lds
        print(task, seed, {name: round(float(value), 2) for name, value in lds.items()}, flush=True)
    table = pd.concat(rows, ignore_index=True)
    summary = paired(table)
    print(summary[summary.metric == "lds"].round(3).to_string(index=False))
    report(summary, args.csv.with_name(args.csv.stem + "_summary.csv") if args.csv else None)
    return report(table, args.csv)


if __name__ == "__main__":
    main()
