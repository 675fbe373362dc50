"""Which of AT2's differences from longprobe's ``at2`` costs its LDS: features, training sources and fit,
each changed alone, refit and judged on new seeds.

Prompted by the peers' run (issue 37, item 4): AT2 0.0.1's estimator, trained by AT2's own trainer on the
20 training samples longprobe's ``at2`` learns from, is below ours by LDS −0.29 [−0.39, −0.18] on the 24
held-out SmolLM2 samples (RESULTS.md, "Peers beside us"). The two differ in (``analyses/peers/at2/NOTES.md``)
1. the features: AT2 uses the answer's attention weights only, ours the attention mass **and**
   |A ⊙ ∂L/∂A| of every head (:func:`probe.probes.at2.token_features`);
2. the sources they train on: every token (AT2), the sentences they then score (ours);
3. the fit: a Pearson loss by Adam, L1-normalised (AT2), ridge with a cross-validated penalty (ours).

This refits on the same training samples (``analyses.learn_head_weights``' defaults: ``multihop-1`` and
``multihop-2`` at 1K, seeds 1000–1009, 32 random half masks each) with one difference at a time
(:data:`VARIANTS`): ``both`` is longprobe's ``at2`` (with the default settings, the bundled weights: the
script prints how far apart), ``attention`` and ``saliency`` a feature set alone, ``tokens`` trains on
32 random half masks of the sample's tokens (each token of a source a source of its own: AT2's training
sources), ``Pearson`` fits by :func:`pearson_fit` (AT2's recipe, written here) instead of
:func:`probe.probes.at2.fit`'s ridge; ``attention, tokens, Pearson`` is AT2's recipe in longprobe's pipeline.
``AT2's estimator`` applies AT2's trained weights (``analyses/peers/at2/estimators/MODEL.pt``, its
attention features' layout ``[layers · heads]``) to longprobe's attention features: what is left of
AT2's own run once the weights are fixed. All are judged on new-seed samples of the held-out study's
tasks (seeds 23000–23002, 12 samples; LDS on 32 random half masks of each sample), beside the detectors
read off the same pass; paired differences from ``both``, 95 % bootstrap intervals over samples
(:func:`source_reduce.paired`). One thread:

    python -m analyses.at2_features --csv bench/results/at2_features.csv

``--journal DIR`` keeps each masked pass as it finishes, so a killed run goes on there.

``--at2-masks``: instead, AT2's recipe on AT2's own training masks (mask i kept each token with probability
1/2 from ``numpy.random.RandomState(i)``, i = 0..31, as AT2's ``create_masks``) fit by :func:`pearson_fit`
on the training samples, against AT2's trained estimator (max |Δ| and Spearman of the weights), and, with
``--at2-training DIR`` (AT2's ``train/MODEL-20-32/features_and_outputs``), :func:`pearson_weights` on
AT2's own stored rows against its estimator (is the optimiser the same? :func:`optimiser_check`) and AT2's
stored training rows of the first training sample — ``(2·kept − 1) @ features`` per mask and head, and the
logit-probability of the answer — against ours on the same masks, per layer:

    python -m analyses.at2_features --at2-masks --model gemma3-270m \
        --at2-training .venv-peers/at2/train/gemma3-270m-20-32/features_and_outputs

``--at2-training DIR`` alone: :func:`optimiser_check` only (no model is loaded).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.stats import pearsonr, spearmanr

from bench.harness import journaled, new_seed_samples, report, samples_parser
from probe import faithfulness, tasks
from probe.probes import at2
from probe.probes.attribution import answer_attribution

from .learn_head_weights import TRAIN_SEED, ablation_record, sample_record
from .source_reduce import paired

TRAIN_TASKS = ("multihop-1", "multihop-2")  # analyses.learn_head_weights' defaults
ESTIMATORS = Path(__file__).parent / "peers" / "at2" / "estimators"
# name: (indices into token_features' first axis, training sources, fit)
VARIANTS = {
    "both": ([0, 1], "sentences", "ridge"),
    "attention": ([0], "sentences", "ridge"),
    "saliency": ([1], "sentences", "ridge"),
    "attention, tokens": ([0], "tokens", "ridge"),
    "attention, Pearson": ([0], "sentences", "Pearson"),
    "attention, tokens, Pearson": ([0], "tokens", "Pearson"),
}


def token_sample(sample: tasks.Sample) -> tasks.Sample:
    """``sample`` with every token of every source a source of its own (AT2's training sources)."""
    tokens = {
        category: [token for start, end in spans for token in range(start, end)]
        for category, spans in sample.spans.items()
        if category in tasks.CONTEXT_CATEGORIES
    }
    return dataclasses.replace(
        sample,
        spans={**sample.spans, **{c: [(t, t + 1) for t in found] for c, found in tokens.items()}},
        char_spans={
            **sample.char_spans,
            **{c: [tuple(map(int, sample.offsets[t])) for t in found] for c, found in tokens.items()},
        },
    )


def pearson_weights(
    x: torch.Tensor, y: torch.Tensor, steps: int = 1000, order: np.random.RandomState | None = None
) -> torch.Tensor:
    """Weights Tensor[F] by AT2's recipe (``analyses/peers/at2/NOTES.md``, "Training"; Cohen-Wang et al.
    2025) from regression rows ``x`` [samples, masks, F] and targets ``y`` [samples, masks]: every weight
    starts at 1 / F, Adam (lr 10⁻³, cosine schedule over ``steps``, gradient norm clipped at 1) minimises
    the negative Pearson correlation of ``x · θ`` with ``y`` over each sample's masks, averaged over
    samples; θ is then L1-normalised. ``order``: each step takes the samples in an order drawn from it,
    as AT2's trainer draws its batch (the same loss, summed in another order); default, as given."""
    theta = torch.full((x.shape[-1],), 1 / x.shape[-1], requires_grad=True)
    optimizer = torch.optim.Adam([theta], lr=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

    def centred(values: torch.Tensor) -> torch.Tensor:
        return values - values.mean(-1, keepdim=True)

    for _ in range(steps):
        taken = slice(None) if order is None else order.permutation(len(x))
        optimizer.zero_grad()
        prediction, target = centred(x[taken] @ theta), centred(y[taken])
        loss = -torch.nn.functional.cosine_similarity(prediction, target, dim=-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([theta], 1.0)
        optimizer.step()
        schedule.step()
    theta = theta.detach()
    return theta / theta.abs().sum()


def pearson_fit(
    features: list[torch.Tensor], kept: list[torch.Tensor], logprob: list[torch.Tensor]
) -> torch.Tensor:
    """Weights Tensor[features, layers, heads] by :func:`pearson_weights` on the rows ``kept · features``
    of each sample's masks; arguments as :func:`probe.probes.at2.fit`'s (every sample the same number of
    masks)."""
    x = torch.stack([k.float() @ f.reshape(len(f), -1).float() for f, k in zip(features, kept, strict=True)])
    y = torch.stack([lp.float() for lp in logprob])
    return pearson_weights(x, y).reshape(features[0].shape[1:])


def at2_masks(n_sources: int, n_masks: int) -> torch.Tensor:
    """BoolTensor[masks, sources] (True = kept): AT2's training masks, mask i drawn by
    ``RandomState(i)``, each source kept with probability 1/2."""
    draws = [
        np.random.RandomState(i).choice([False, True], size=n_sources, p=[0.5, 0.5]) for i in range(n_masks)
    ]
    return torch.from_numpy(np.stack(draws))


def at2_estimator(model: str) -> torch.Tensor | None:
    """AT2's trained weights for ``model`` (``estimators/MODEL.pt``) as Tensor[layers · heads], its
    attention features' layout; ``None`` where none was trained."""
    path = ESTIMATORS / f"{model}.pt"
    if not path.exists():
        return None
    return torch.load(path, weights_only=True)["state_dict"]["linear.weight"].flatten()


def recipe_check(train: list[dict], own: torch.Tensor, stored: Path | None) -> pd.DataFrame:
    """AT2's recipe refit on ``train`` (token records on AT2's masks) against AT2's trained weights ``own``
    (:func:`at2_estimator`); with ``stored`` (AT2's ``features_and_outputs`` folder), its first training
    sample's rows against ours, one row per layer and one for the answer's score."""
    features = [r["features"][:, [0]] for r in train]
    refit = pearson_fit(features, [r["kept"] for r in train], [r["logprob"] for r in train]).flatten()
    gap, largest = float((refit - own).abs().max()), float(own.abs().max())
    print(f"AT2's recipe here − AT2's estimator: max |Δ| {gap:.2e} (largest weight {largest:.2e}), "
          f"Spearman {spearmanr(refit, own)[0]:.4f}")  # fmt: skip
    if stored is None:
        return pd.DataFrame()
    rows, outputs = stored_rows(stored)
    print(optimiser_check(rows, outputs, own).to_string(index=False))

    def compared(rows: str, ours: np.ndarray, theirs: np.ndarray) -> dict:
        return {"rows": rows, "max_abs_diff": np.abs(ours - theirs).max(), "largest": np.abs(theirs).max(),
                "pearson": pearsonr(ours.ravel(), theirs.ravel())[0]}  # fmt: skip

    first = train[0]
    _, _, layers, heads = first["features"].shape
    ours = (
        ((2 * first["kept"].float() - 1) @ first["features"][:, 0].flatten(1))
        .numpy()
        .reshape(-1, layers, heads)
    )
    theirs = rows[0].reshape(-1, layers, heads)
    table = [compared(f"layer {layer}", ours[:, layer], theirs[:, layer]) for layer in range(layers)]
    table.append(compared("answer: log-prob. vs AT2's logit-prob.", first["logprob"].numpy(), outputs[0]))
    return pd.DataFrame(table)


def stored_rows(stored: Path) -> tuple[np.ndarray, np.ndarray]:
    """AT2's stored training rows [samples, masks, F] and answer scores [samples, masks] (float32) from its
    ``features_and_outputs`` folder ``stored``."""
    return tuple(
        np.load(stored / f"{name}_0_of_1.npy").astype(np.float32) for name in ("features", "outputs")
    )


def optimiser_check(rows: np.ndarray, outputs: np.ndarray, own: torch.Tensor) -> pd.DataFrame:
    """:func:`pearson_weights` on AT2's stored training ``rows`` and ``outputs`` (:func:`stored_rows`)
    against AT2's estimator ``own`` [F], one row per fit: the samples in their stored order, and in 5
    random orders a step (AT2's trainer draws its batch in a new order each step, so how far these land
    from each other is how far its own result moves with the order of a float sum)."""
    x, y = torch.from_numpy(rows), torch.from_numpy(outputs)
    fits = {"stored order": pearson_weights(x, y)}
    fits |= {
        f"random order {seed}": pearson_weights(x, y, order=np.random.RandomState(seed))
        for seed in range(1, 6)
    }
    return pd.DataFrame(
        {"fit": name, "max_abs_diff": float((theta - own).abs().max()), "largest": float(own.abs().max()),
         "spearman": spearmanr(theta, own)[0]}
        for name, theta in fits.items()
    )  # fmt: skip


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = samples_parser(__doc__)
    parser.add_argument("--train-samples", type=int, default=10, help="per training task, seeds 1000 on")
    parser.add_argument("--masks", type=int, default=32, help="random half masks a sample")
    parser.add_argument(
        "--at2-masks", action="store_true", help="AT2's recipe on its own masks vs its weights"
    )
    parser.add_argument("--at2-training", type=Path, default=None, help="AT2's features_and_outputs folder")
    given = parser.parse_args(argv)
    if given.at2_training is not None and not given.at2_masks:  # AT2's stored rows alone: no model
        rows = stored_rows(given.at2_training)
        return report(optimiser_check(*rows, at2_estimator(given.model)), given.csv)
    args, model, tokenizer, _ = new_seed_samples(
        __doc__, argv, tasks.HELD_OUT_TASKS, range(23000, 23003), parser
    )
    with journaled(args, "at2_features"):
        return refit_and_judge(args, model, tokenizer)


def refit_and_judge(args, model, tokenizer) -> pd.DataFrame:
    """:func:`main`'s work: the training records, each variant's weights, and their LDS on the new seeds
    (or, with ``--at2-masks``, the recipe check)."""

    def record(task: str, seed: int, held_out: bool) -> dict:
        return sample_record(model, tokenizer, task, args.length, seed, args.masks, held_out=held_out)

    def token_record(task: str, seed: int, masks=faithfulness.random_masks) -> dict:
        sample = token_sample(tasks.make(task, tokenizer, args.length, seed=seed, model=model))
        attribution = answer_attribution(model, sample.input_ids, sample.target_positions)
        return ablation_record(model, sample, attribution, masks(len(sample.sources), args.masks))

    seeds = [(task, TRAIN_SEED + i) for task in TRAIN_TASKS for i in range(args.train_samples)]
    if args.at2_masks:
        train = [token_record(task, seed, at2_masks) for task, seed in seeds]
        return report(recipe_check(train, at2_estimator(args.model), args.at2_training), args.csv)
    train = {
        "sentences": [record(task, seed, False) for task, seed in seeds],
        "tokens": [token_record(task, seed) for task, seed in seeds],
    }
    weights = {}  # name: (indices into the features' first axis, θ)
    for name, (index, sources, how) in VARIANTS.items():
        found = [r["features"][:, index] for r in train[sources]], [r["kept"] for r in train[sources]]
        logprob = [r["logprob"] for r in train[sources]]
        if how == "ridge":
            theta, alpha, _ = at2.fit(*found, logprob)
            print(f"at2 ({name}): ridge penalty {alpha:g}", flush=True)
        else:
            theta = pearson_fit(*found, logprob)
        weights[name] = index, theta
    bundled = at2.HeadWeights.bundled(model)
    if bundled is not None:  # the refit `both` is the bundled `at2` where these are its training settings
        apart, largest = (weights["both"][1] - bundled.weights).abs().max(), bundled.weights.abs().max()
        print(
            f"refit `both` − bundled at2 weights (penalty {bundled.settings['alpha']:g}): max |Δ| "
            f"{float(apart):.3g}, {float(apart / largest):.2g} of the largest bundled weight"
        )
    own = at2_estimator(args.model)
    if own is not None:
        weights["AT2's estimator"] = [0], own.reshape(weights["attention"][1].shape)
    rows = []
    for task in args.tasks:
        for seed in args.seeds:
            judged = record(task, seed, True)
            scores = {
                **{f"at2 ({name})": at2.source_scores(judged["features"][:, index], theta)
                   for name, (index, theta) in weights.items()},
                **judged["scores"],
            }  # fmt: skip
            for name, value in scores.items():
                lds = faithfulness.lds(value, judged["kept"], judged["logprob"])
                rows.append({"task": task, "seed": seed, "detector": name, "reduce": "own", "lds": lds})
                print(task, seed, name, round(lds, 3), flush=True)
    per_sample = pd.DataFrame(rows)
    summary = paired(per_sample, ("at2 (both)", "own"))
    by_task = per_sample.pivot_table(index="detector", columns="task", values="lds").add_prefix("lds_")
    summary = summary.merge(by_task[[f"lds_{task}" for task in args.tasks]], on="detector")
    return report(summary.sort_values("value", ascending=False), args.csv)


if __name__ == "__main__":
    main()
