"""Why ``at2`` turns against the ablations at 4K: its learned head weights split by sign and by feature,
judged on a held-out study's saved passes.

``at2`` scores a source Σ_{f,l,h} θ[f, l, h] · F[f, l, h, source] (:mod:`probe.probes.at2`), with weights θ
learned
at 1K. For every ``multihop-4`` and ``kv`` sample whose passes a study saved, one shared pass gives the
features F; each part of the score is then judged by LDS on the study's own 32 LDS masks (read from its
saved passes, no masked pass runs):

- ``at2``: θ · F (its LDS is checked equal to the study's own ``at2`` row; not with ``--weights FILE``,
  other learned weights, e.g. for a model without bundled ones);
- ``positive`` / ``negative``: only the heads with θ > 0 / θ < 0 (signed as in the score);
- ``attention`` / ``saliency``: only the attention-mass / saliency feature.

Beside each part, ``spread``: the standard deviation of its source scores over the sample's sources, so
that one can see which part dominates the ranking. Nothing is tuned: this explains a measured failure.

    python -m analyses.at2_length figures/studies/detector_smollm2-135m-1024_faffad12 \
        figures/studies/detector_smollm2-135m-4096_196423fa --csv bench/results/at2_length.csv
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

import probe
from bench.harness import intervals, report_with_summary, saved_passes_parser, study_masks
from probe import faithfulness, tasks
from probe.probes.at2 import HeadWeights, source_features, source_scores, token_features
from probe.probes.attribution import answer_attribution

from .length_ranking import faithfulness_studies
from .study_files import saved_passes

TASKS = ("multihop-4", "kv")  # built without the model (key-token searches for its token with it)


def parts(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """The weights θ [features, layers, heads] of each part of the score, the rest set to 0."""
    zero = torch.zeros_like(weights)
    by_feature = {name: zero.index_copy(0, torch.tensor([i]), weights[i : i + 1]) for i, name in
                  enumerate(("attention", "saliency"))}  # fmt: skip
    return {"at2": weights, "positive": weights.clamp(min=0), "negative": weights.clamp(max=0), **by_feature}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = saved_passes_parser(__doc__)
    parser.add_argument(
        "--weights", type=Path, default=None,
        help="head weights learned for the studies' model (analyses.learn_head_weights --weights-out); "
        "default: the bundled ones, which the studies' own at2 ran with (its LDS is checked against them)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for study in args.studies:
        (judged,) = faithfulness_studies(study)
        model_name, length = judged.model.iloc[0], int(judged.length.iloc[0])
        model, tokenizer = probe.load_model(model_name)
        weights = HeadWeights.for_model(model, args.weights).weights
        saved = saved_passes(study, model_name, length)
        own = judged[judged.scorer == "at2"].set_index(["task", "seed"]).lds
        for (task, seed), passes in tqdm(
            list(saved.groupby(["task", "seed"])), desc=f"{model_name} {length}"
        ):
            if task not in TASKS:
                continue
            sample = tasks.make(task, tokenizer, length, seed, model=model)
            known = faithfulness.Ablations.from_frame(passes, sample)
            kept, _ = study_masks(len(sample.sources), args.masks, args.ceiling_masks, args.mask_seed)
            actual = known.logprob_of(kept)
            attribution = answer_attribution(model, sample.input_ids, sample.target_positions)
            features = source_features(token_features(attribution), sample)
            scores = {part: source_scores(features, theta) for part, theta in parts(weights).items()}
            judged_parts = {part: faithfulness.lds(score, kept, actual) for part, score in scores.items()}
            if args.weights is None and abs(judged_parts["at2"] - own[task, seed]) > 1e-6:
                raise AssertionError(f"{task} {seed}: at2's LDS is not the study's own {own[task, seed]:.4f}")
            about = {"model": model_name, "length": length, "task": task, "seed": seed}
            rows += [{**about, "part": part, "lds": judged_parts[part], "spread": float(score.std())}
                     for part, score in scores.items()]  # fmt: skip
    table = pd.DataFrame(rows)
    return report_with_summary(
        table, intervals(table, ["model", "length", "part"], ["lds", "spread"]), args.csv
    )


if __name__ == "__main__":
    main()
