"""Which of AT2's differences from longprobe's ``at2`` costs its LDS: the head features, refit and judged
on new seeds.

Prompted by the peers' run (issue 37, item 4): AT2 0.0.1's estimator, trained by AT2's own trainer on the
20 training samples longprobe's ``at2`` learns from, is below ours by LDS −0.29 [−0.39, −0.18] on the 24
held-out SmolLM2 samples (RESULTS.md, "Peers beside us"). The two differ in (``bench/peers/at2/NOTES.md``)
1. the features: AT2 uses the answer's attention weights only, ours the attention mass **and**
   |A ⊙ ∂L/∂A| of every head (:func:`probe.at2.token_features`);
2. the sources they train on: every token (AT2), the sentences they then score (ours);
3. the fit: a Pearson loss by Adam, L1-normalised (AT2), ridge with a cross-validated penalty (ours).

This refits longprobe's ridge (:func:`probe.at2.fit`) on the same training samples
(``analyses.learn_head_weights``' defaults: ``multihop-1`` and ``multihop-2`` at 1K, seeds 1000–1009, 32
random half masks each) with each feature set — ``both`` (longprobe's ``at2``), ``attention`` (AT2's),
``saliency`` — and judges the three on new-seed samples of the held-out study's tasks (seeds 23000–23002,
12 samples; LDS on 32 random half masks of each sample), beside the detectors read off the same pass.
With the default training settings ``both`` is the bundled ``at2`` (the script prints how far apart).
Paired differences from ``both``, 95 % bootstrap intervals over samples. If ``attention`` alone falls about
as far as AT2 did, the features are the cause; if not, the sources or the fit are. One thread:

    python bench/at2_features.py --csv bench/results/at2_features.csv
"""

from __future__ import annotations

import pandas as pd
from harness import new_seed_samples, report, samples_parser

from analyses.learn_head_weights import TRAIN_SEED, sample_record
from probe import at2, faithfulness, stats

TASKS = ("multihop-4", "kv", "document-2", "key-token")  # the held-out study's
TRAIN_TASKS = ("multihop-1", "multihop-2")  # analyses.learn_head_weights' defaults
FEATURES = {"both": [0, 1], "attention": [0], "saliency": [1]}  # indices into token_features' first axis


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = samples_parser(__doc__)
    parser.add_argument("--train-samples", type=int, default=10, help="per training task, seeds 1000 on")
    parser.add_argument("--masks", type=int, default=32, help="random half masks a sample")
    args, model, tokenizer, _ = new_seed_samples(__doc__, argv, TASKS, range(23000, 23003), parser)

    def record(task: str, seed: int, held_out: bool) -> dict:
        return sample_record(model, tokenizer, task, args.length, seed, args.masks, held_out=held_out)

    train = [record(task, TRAIN_SEED + i, False) for task in TRAIN_TASKS for i in range(args.train_samples)]
    weights = {
        name: at2.fit(
            [r["features"][:, index] for r in train],
            [r["kept"] for r in train],
            [r["logprob"] for r in train],
        )[0]
        for name, index in FEATURES.items()
    }
    bundled = at2.HeadWeights.bundled(model)
    if bundled is not None:  # the refit `both` is the bundled `at2` where these are its training settings
        print(
            "refit `both` − bundled at2 weights, max |Δ|:",
            float((weights["both"] - bundled.weights).abs().max()),
        )
    rows = []
    for task in args.tasks:
        for seed in args.seeds:
            judged = record(task, seed, True)
            scores = {
                **{f"at2 ({name})": at2.source_scores(judged["features"][:, index], weights[name])
                   for name, index in FEATURES.items()},
                **judged["scores"],
            }  # fmt: skip
            for name, value in scores.items():
                lds = faithfulness.lds(value, judged["kept"], judged["logprob"])
                rows.append({"task": task, "seed": seed, "scorer": name, "lds": lds})
                print(task, seed, name, round(lds, 3), flush=True)
    per_sample = pd.DataFrame(rows)
    wide = per_sample.pivot_table(index=["task", "seed"], columns="scorer", values="lds")
    summary = []
    for name in wide.columns:
        value, gap = (
            stats.bootstrap(wide[name].to_numpy()),
            stats.bootstrap((wide[name] - wide["at2 (both)"]).to_numpy()),
        )
        summary.append({"scorer": name, "samples": value.n, "lds": value.value, "low": value.low,
                        "high": value.high, "minus_both": gap.value, "minus_both_low": gap.low,
                        "minus_both_high": gap.high,
                        **{f"lds_{task}": wide.loc[task, name].mean() for task in args.tasks}})  # fmt: skip
    return report(pd.DataFrame(summary).sort_values("lds", ascending=False), args.csv)


if __name__ == "__main__":
    main()
