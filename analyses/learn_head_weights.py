"""Learn AT2 head weights (:mod:`probe.probes.at2`) for a model from its own ablations; validate them held
out.

Training samples: ``--train-samples`` per task of ``--tasks`` at ``--length`` tokens, seeds from 1000
(apart from the main job's seeds). For each sample, one forward+backward over every layer gives the
per-head features, and ``--masks`` random source masks (each source kept with probability 1/2,
compacted passes) give the gold answer's log-probability the weights are fit to
(:func:`probe.probes.at2.fit`, the ridge penalty chosen by grouped cross-validation).

Held out, three sets: ``seeds`` (new seeds of the training tasks), ``task`` (``--heldout-task`` at
``--length``) and ``length`` (the training tasks at ``--heldout-length``). On each, the LDS of ``at2``
beside the one-pass detectors read off the same pass (``information_flow``, ``attention``,
``embedding_grad``, ``grad_times_input``) and ``key_removal_grad``, each with a bootstrap interval over
samples, and the paired difference ``at2 − information_flow``.

Writes ``probe/data/head_weights/{model}.json`` (the weights the ``at2`` detector loads for this
architecture; ``--weights-out``), ``{out}/head_weights_{model}.{png,csv}`` (held-out LDS) and
``{out}/head_weights_{model}_alphas.csv`` (cross-validated LDS per penalty). Resumable (``--resume``).

    python -m analyses.learn_head_weights                          # SmolLM2-135M at 1K, ~30 min on 1 core
    python -m analyses.learn_head_weights --model gemma3-270m
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch

import probe
from probe import detectors, faithfulness, stats, tasks
from probe.probes import at2
from probe.probes.attribution import AnswerAttribution, answer_attribution

from .arguments import add_device_arguments, check_device_arguments, check_out, load
from .output import atomic_write, save_figure
from .sweep import finish, sweep

READ_OFF = ("information_flow", "attention", "embedding_grad", "grad_times_input")
COMPARED = ("at2", *READ_OFF, "key_removal_grad")
TRAIN_SEED = 1000


def ablation_record(model, sample: tasks.Sample, attribution: AnswerAttribution, kept: torch.Tensor) -> dict:
    """``sample``'s features Tensor[sources, features, layers, heads] from ``attribution``, the masks
    ``kept`` BoolTensor[masks, sources] (True = kept) and the answer's log-probability under each
    Tensor[masks]."""
    features = at2.source_features(at2.token_features(attribution), sample)
    logprob = faithfulness.answer_scores(model, sample, ~kept).logprob
    return {"features": features, "kept": kept, "logprob": logprob}


def sample_record(model, tokenizer, task: str, length: int, seed: int, n_masks: int, held_out: bool) -> dict:
    """One sample's features Tensor[sources, features, layers, heads], masks, log-probabilities and,
    held out, the compared detectors' source scores."""
    sample = tasks.make(task, tokenizer, length, seed=seed, model=model)
    attribution = answer_attribution(model, sample.input_ids, sample.target_positions)
    kept = faithfulness.random_masks(len(sample.sources), n_masks, seed=0)
    record = ablation_record(model, sample, attribution, kept)
    if held_out:
        found = {name: detectors.from_attribution(name, model, attribution, sample) for name in READ_OFF}
        found["key_removal_grad"] = probe.detect("key_removal_grad", model, tokenizer, sample)
        record["scores"] = {name: detection.source_scores(sample) for name, detection in found.items()}
    return record


def held_out_lds(records: pd.DataFrame, weights: torch.Tensor) -> pd.DataFrame:
    """One row per held-out sample and detector: its LDS on the sample's own masks."""
    rows = []
    for record in records.itertuples():
        scores = {"at2": at2.source_scores(record.features, weights), **record.scores}
        for name in COMPARED:
            value = faithfulness.lds(scores[name], record.kept, record.logprob)
            rows.append({"set": record.set, "task": record.task, "length": record.length,
                         "seed": record.seed, "detector": name, "lds": value})  # fmt: skip
    return pd.DataFrame(rows)


def summarize(lds: pd.DataFrame) -> pd.DataFrame:
    """Mean LDS per set and detector with its bootstrap interval, and at2 − information_flow paired."""
    rows = []
    for (group, name), part in lds.groupby(["set", "detector"], sort=False):
        estimate = stats.bootstrap(part.lds.to_numpy())
        rows.append({"set": group, "detector": name, "lds": estimate.value, "low": estimate.low,
                     "high": estimate.high, "samples": estimate.n})  # fmt: skip
    wide = lds.pivot_table(index=["set", "task", "length", "seed"], columns="detector", values="lds")
    for group, part in wide.groupby(level="set", sort=False):
        estimate = stats.bootstrap((part["at2"] - part["information_flow"]).to_numpy())
        rows.append({"set": group, "detector": "at2 − information_flow", "lds": estimate.value,
                     "low": estimate.low, "high": estimate.high, "samples": estimate.n})  # fmt: skip
    return pd.DataFrame(rows)


def plot(summary: pd.DataFrame) -> plt.Figure:
    data = summary[summary.detector.isin(COMPARED)]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    sets = list(dict.fromkeys(data.set))
    offsets = np.linspace(-0.25, 0.25, len(sets))
    for offset, group, color in zip(offsets, sets, sns.color_palette("deep"), strict=False):
        part = data[data.set == group].set_index("detector").reindex(COMPARED)
        x = np.arange(len(COMPARED)) + offset
        ax.errorbar(x, part.lds, yerr=[part.lds - part.low, part.high - part.lds], fmt="o", color=color,
                    capsize=3, label=f"held out: {group} (n = {int(part.samples.max())})")  # fmt: skip
    ax.set_xticks(range(len(COMPARED)), COMPARED, rotation=20)
    ax.axhline(0, color="grey", linewidth=0.8, linestyle=":")
    ax.set(
        ylabel="LDS (mean, 95 % bootstrap interval)", title="Learned head weights (at2) on held-out samples"
    )
    ax.legend(loc="lower left", fontsize=8)
    return fig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="model name or local HF folder")
    parser.add_argument("--tasks", nargs="+", default=["multihop-1", "multihop-2"], choices=tasks.names())
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--train-samples", type=int, default=10, help="training samples per task")
    parser.add_argument("--heldout-samples", type=int, default=3, help="held-out seeds per training task")
    parser.add_argument("--heldout-task", default="multihop-3", choices=tasks.names())
    parser.add_argument("--heldout-task-samples", type=int, default=4)
    parser.add_argument("--heldout-length", type=int, default=2048)
    parser.add_argument("--heldout-length-samples", type=int, default=1, help="per training task")
    parser.add_argument("--masks", type=int, default=32, help="random source masks per sample")
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.add_argument("--weights-out", type=Path, default=None, help="default: the bundled weights file")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    if args.masks < 2 or min(args.train_samples, args.heldout_samples) < 1:
        parser.error("--masks must be at least 2 and every sample count at least 1")
    if args.train_samples * len(args.tasks) < 2:
        parser.error("fitting needs at least 2 training samples")
    check_out(parser, args.out)
    check_device_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parse_args(argv)
    model, tokenizer = load(args)
    name = Path(args.model).name
    jobs = [
        ("train", task, args.length, TRAIN_SEED + i) for task in args.tasks for i in range(args.train_samples)
    ]
    first_heldout = TRAIN_SEED + args.train_samples
    jobs += [
        ("seeds", task, args.length, first_heldout + i)
        for task in args.tasks
        for i in range(args.heldout_samples)
    ]
    jobs += [
        ("task", args.heldout_task, args.length, TRAIN_SEED + i) for i in range(args.heldout_task_samples)
    ]
    jobs += [("length", task, args.heldout_length, TRAIN_SEED + i) for task in args.tasks
             for i in range(args.heldout_length_samples)]  # fmt: skip

    def run(job: tuple) -> dict[str, pd.DataFrame]:
        group, task, length, seed = job
        record = sample_record(model, tokenizer, task, length, seed, args.masks, held_out=group != "train")
        return {
            "records": pd.DataFrame([{"set": group, "task": task, "length": length, "seed": seed, **record}])
        }

    settings = f"{name}-{args.length}-{args.masks}"
    chosen = {
        key: value
        for key, value in vars(args).items()
        if key not in ("resume", "out", "weights_out", "device")
    }
    parts = args.out / f".head_weights_{settings}_parts"
    found = sweep(jobs, run, parts, args.resume, desc="head weights", settings=chosen)
    if found is None:
        return pd.DataFrame()
    records = found["records"]
    train = records[records.set == "train"]
    weights, alpha, alphas = at2.fit(list(train.features), list(train.kept), list(train.logprob))
    lds = held_out_lds(records[records.set != "train"], weights)
    summary = summarize(lds)
    validation = {row.set: round(row.lds, 4) for row in summary[summary.detector == "at2"].itertuples()}
    result = at2.HeadWeights(
        weights,
        {
            "name": name,
            "model": at2.fingerprint(model),
            "tasks": args.tasks,
            "length": args.length,
            "train_samples": len(train),
            "train_seeds": [TRAIN_SEED, TRAIN_SEED + args.train_samples - 1],
            "masks": args.masks,
            "alpha": alpha,
            "validation": validation,
        },
    )
    result.save(args.weights_out or at2.BUNDLED / f"{name}.json")
    save_figure(plot(summary), summary, args.out, f"head_weights_{name}")
    atomic_write(args.out / f"head_weights_{name}_alphas.csv", lambda tmp: alphas.to_csv(tmp, index=False))
    finish(parts)  # every output is written: a --resume now runs nothing
    print(
        f"alpha = {alpha}\n{alphas.round(3).to_string(index=False)}\n\n"
        f"{summary.round(3).to_string(index=False)}"
    )
    return summary


if __name__ == "__main__":
    main()
