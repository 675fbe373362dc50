"""LongPPL at small scale on the real models (seed 000, §2 and §4.1), with ``probe.lsd``.

1. **Answer tokens** (§2, Figs. 2–4). LongEval ``lines`` samples (full record, gold answer
   teacher-forced, the asked line in the first 60 % so it sits more than K tokens back) at several
   prompt lengths. For the tokens of the question and the answer (the prefix "The <REGISTER_CONTENT>
   in line … is" and the number): LSD and LCL; per (model, length) the accuracy (every answer token is
   the greedy prediction) against the PPL of answer and of non-answer tokens; and how well
   LSD > α alone and LSD > α and LCL > β classify answer vs non-answer tokens (paper: 85.6 % / 98.2 %).
2. **LongPPL vs PPL as predictors** (Table 1, Fig. 1b). Model variants with different long-context
   ability — SmolLM2 and Gemma 3 with attention limited to the last W tokens
   (:func:`probe.attention_window`) — get PPL, LongPPL and LongPPL-soft on Paul Graham essay
   text (:func:`probe.tasks.noise.essay_documents`), key tokens chosen by one fixed evaluator (full
   Gemma 3; SmolLM2's tokens are aligned by characters), each pooled per token over the documents
   (:func:`probe.lsd.pool_longppl`), and teacher-forced accuracy on passkey (and, in full runs,
   lines and multihop-1) at the same length; Pearson correlations across variants.

K and d are small (our models are small and slow on CPU): the defaults K = d = 128.

    python -m analyses.longppl            # quick: ~5 min on 2 idle cores
    python -m analyses.longppl --full     # both models as evaluators, 20 samples, tasks at 2K

Writes ``figures/longppl_answer_ppl``, ``longppl_answer_lsd``, ``longppl_correlation`` (PNG + CSV),
``longppl_answer_tokens.csv`` (one row per token) and ``longppl.md`` (the tables for the README).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch
from scipy.stats import pearsonr
from sklearn.metrics import accuracy_score, balanced_accuracy_score
from tqdm.auto import tqdm

import probe
from analyses.output import atomic_write, save_figure
from probe import logprobs, lsd, tasks
from probe.tasks.noise import essay_documents

MAX_DEPTH = 0.6  # the asked line / needle lies in the first 60 % of the context


def sample_depth(seed: int) -> float:
    return float(np.random.default_rng(seed).uniform(0, MAX_DEPTH))


def answer_token_rows(model, tokenizer, name: str, length: int, seed: int, K: int, d: int) -> pd.DataFrame:
    """One row per question / answer token of a ``lines`` sample: kind, LSD, LCL, greedy."""
    sample = tasks.make("lines", tokenizer, length, seed=seed, depth=sample_depth(seed))
    (question, _), *_ = sample.spans["question"]
    (answer_start, answer_end), *_ = sample.spans["answer"]
    target_positions = torch.arange(question, answer_end)
    long = logprobs.long_logprobs(model, sample.input_ids, target_positions)
    short = logprobs.short_logprobs(model, sample.input_ids, K, d, target_positions=target_positions)
    return pd.DataFrame(
        {
            "model": name,
            "length": length,
            "seed": seed,
            "position": target_positions.numpy(),
            "kind": np.where(target_positions >= answer_start, "answer", "non-answer"),
            "lsd": (long.target - short.target)[target_positions].numpy(),
            "lcl": long.target[target_positions].numpy(),
            "greedy": long.greedy[target_positions].numpy(),
        }
    )


def answer_points(tokens: pd.DataFrame) -> pd.DataFrame:
    """Per (model, length): accuracy and the PPL of answer / non-answer tokens (Fig. 2b–c)."""
    correct = tokens[tokens.kind == "answer"].groupby(["model", "length", "seed"]).greedy.all()
    nll = tokens.assign(nll=-tokens.lcl).pivot_table(index=["model", "length"], columns="kind", values="nll")
    points = correct.groupby(["model", "length"]).mean().rename("accuracy").to_frame()
    points["ppl_answer"] = np.exp(nll["answer"])
    points["ppl_non_answer"] = np.exp(nll["non-answer"])
    return points.reset_index()


def classification(tokens: pd.DataFrame, alpha: float, beta: float) -> pd.DataFrame:
    """Accuracy of LSD > α and of LSD > α ∧ LCL > β at telling answer tokens from the others (Fig. 4b)."""
    rows = []
    for model, group in tokens.dropna(subset=["lsd"]).groupby("model"):
        truth = group.kind == "answer"
        rules = {"LSD only": group.lsd > alpha, "LSD + LCL": (group.lsd > alpha) & (group.lcl > beta)}
        for rule, predicted in rules.items():
            rows.append(
                dict(
                    model=model,
                    rule=rule,
                    accuracy=accuracy_score(truth, predicted),
                    balanced_accuracy=balanced_accuracy_score(truth, predicted),
                    answer_tokens=int(truth.sum()),
                    other_tokens=int((~truth).sum()),
                )
            )
    return pd.DataFrame(rows)


def plot_answer_ppl(points: pd.DataFrame) -> plt.Figure:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, column, title in zip(
        axes, ["ppl_answer", "ppl_non_answer"], ["answer tokens", "non-answer tokens"], strict=True
    ):
        sns.scatterplot(points, x=column, y="accuracy", hue="model", size="length", ax=ax)
        ax.set(xscale="log", xlabel=f"PPL on {title}", title=title)
    fig.suptitle("LongEval lines: accuracy vs perplexity (each point: a model at one prompt length)")
    fig.tight_layout()
    return fig


def plot_answer_lsd(tokens: pd.DataFrame, alpha: float, beta: float) -> plt.Figure:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    scored = tokens.dropna(subset=["lsd"])
    sns.histplot(scored, x="lsd", hue="kind", stat="density", common_norm=False, bins=40, ax=axes[0])
    axes[0].axvline(alpha, color="k", ls="--", lw=1)
    axes[0].set(xlabel="LSD (nats)", title="LSD of answer vs non-answer tokens")
    sns.scatterplot(scored, x="lsd", y="lcl", hue="kind", style="model", s=14, alpha=0.6, ax=axes[1])
    axes[1].axvline(alpha, color="k", ls="--", lw=1)
    axes[1].axhline(beta, color="k", ls="--", lw=1)
    axes[1].set(xlabel="LSD (nats)", ylabel="LCL = log P(x | long)", title="key tokens: upper right")
    fig.tight_layout()
    return fig


def task_accuracy(model, tokenizer, task: str, length: int, samples: int) -> float:
    """Teacher-forced exact match: the share of samples whose answer tokens are all greedy predictions."""
    correct = []
    for seed in range(samples):
        sample = tasks.make(task, tokenizer, length, seed=seed, depth=sample_depth(seed))
        (start, end), *_ = sample.spans["answer"]
        scores = logprobs.long_logprobs(model, sample.input_ids, range(start, end))
        correct.append(bool(scores.greedy[start:end].all()))
    return float(np.mean(correct))


def variant_name(model: str, window: int | None) -> str:
    return f"{model} W={'full' if window is None else window}"


def correlation_table(variants: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for metric in ("ppl", "longppl", "longppl_soft"):
        r, p = pearsonr(variants[metric], variants["accuracy"])
        rows.append(dict(metric=metric, pearson_r=r, p_value=p))
    return pd.DataFrame(rows)


def plot_correlation(variants: pd.DataFrame, table: pd.DataFrame) -> plt.Figure:
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), sharey=True)
    for ax, (_, row) in zip(axes, table.iterrows(), strict=True):
        sns.scatterplot(variants, x=row.metric, y="accuracy", hue="model", style="window", s=60, ax=ax)
        ax.set(title=f"{row.metric}: Pearson r = {row.pearson_r:.2f}", xscale="log")
        if ax is not axes[-1] and ax.get_legend() is not None:  # no legend when every value is NaN
            ax.get_legend().remove()
    fig.suptitle("Model variants (attention limited to the last W tokens): accuracy vs perplexity measures")
    fig.tight_layout()
    return fig


def markdown(classes: pd.DataFrame, points: pd.DataFrame, table: pd.DataFrame, variants: pd.DataFrame) -> str:
    def md(frame: pd.DataFrame) -> str:
        cells = frame.map(lambda v: f"{v:.3g}" if isinstance(v, float) else str(v))
        lines = [" | ".join(frame.columns), " | ".join("---" for _ in frame.columns)]
        return "\n".join(f"| {line} |" for line in lines + [" | ".join(row) for row in cells.values])

    return "\n\n".join(
        [
            "### Answer tokens: classification by LSD / LSD + LCL\n\n" + md(classes),
            "### Accuracy vs PPL on answer / non-answer tokens\n\n" + md(points),
            "### Correlation with accuracy across variants (Pearson)\n\n" + md(table),
            "### Variants\n\n" + md(variants),
        ]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="both evaluators, more samples, tasks at 2K")
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=2.0)
    parser.add_argument("--beta", type=float, default=-2.0)
    parser.add_argument("--answer-models", nargs="+", default=["gemma3-270m"])
    parser.add_argument("--answer-lengths", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--answer-samples", type=int, default=4)
    parser.add_argument("--evaluator", default="gemma3-270m")
    parser.add_argument("--variant-models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--windows", nargs="+", default=["64", "256", "full"])
    parser.add_argument("--length", type=int, default=768, help="essay / task length for the variants")
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--tasks", nargs="+", default=["passkey"])
    parser.add_argument("--task-samples", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    args = parser.parse_args(argv)
    if args.full:
        args.answer_models = ["gemma3-270m", "smollm2-135m"]
        args.answer_lengths, args.answer_samples = [512, 1024, 2048, 4096], 20
        args.windows = ["32", "64", "128", "256", "512", "full"]
        args.length, args.documents, args.task_samples = 2048, 8, 12
        args.tasks = ["passkey", "lines", "multihop-1"]
    args.windows = [None if w == "full" else int(w) for w in args.windows]
    return args


def main(argv: list[str] | None = None) -> dict[str, pd.DataFrame]:
    args = parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    loaded: dict[str, tuple] = {}

    def model(name: str) -> tuple:
        if name not in loaded:
            loaded[name] = probe.load_model(name)
        return loaded[name]

    runs = [
        (m, n, s) for m in args.answer_models for n in args.answer_lengths for s in range(args.answer_samples)
    ]
    tokens = pd.concat(
        [
            answer_token_rows(*model(m), m, n, s, args.K, args.d)
            for m, n, s in tqdm(runs, desc="answer tokens")
        ]
    )
    points, classes = answer_points(tokens), classification(tokens, args.alpha, args.beta)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / "longppl_answer_tokens.csv", lambda tmp: tokens.to_csv(tmp, index=False))
    save_figure(plot_answer_ppl(points), points, args.out, "longppl_answer_ppl")
    save_figure(plot_answer_lsd(tokens, args.alpha, args.beta), classes, args.out, "longppl_answer_lsd")

    evaluator, evaluator_tokenizer = model(args.evaluator)
    settings = dict(K=args.K, d=args.d, alpha=args.alpha, beta=args.beta)
    documents = essay_documents(evaluator_tokenizer, args.length, args.documents)
    keys = [
        lsd.find_key_tokens(text, evaluator, evaluator_tokenizer, **settings)
        for text in tqdm(documents, desc="evaluator key tokens")
    ]
    rows = []
    variants = [(m, w) for m in args.variant_models for w in args.windows]
    for name, window in tqdm(variants, desc="variants"):
        net, tokenizer = model(name)
        with probe.attention_window(net, window):
            pooled = lsd.pool_longppl([lsd.longppl(k.text, net, tokenizer, key_tokens=k) for k in keys])
            accuracy = {
                task: task_accuracy(net, tokenizer, task, args.length, args.task_samples)
                for task in args.tasks
            }
        rows.append(
            dict(
                variant=variant_name(name, window),
                model=name,
                window="full" if window is None else str(window),
                ppl=pooled.ppl,
                longppl=pooled.longppl,
                longppl_soft=pooled.longppl_soft,
                n_key_tokens=pooled.n_key_tokens,
                n_tokens=pooled.n_tokens,
                **{f"accuracy_{task}": value for task, value in accuracy.items()},
                accuracy=np.mean(list(accuracy.values())),
            )
        )
    table = pd.DataFrame(rows)
    correlations = correlation_table(table)
    save_figure(plot_correlation(table, correlations), table, args.out, "longppl_correlation")
    atomic_write(
        args.out / "longppl_correlation_table.csv", lambda tmp: correlations.to_csv(tmp, index=False)
    )
    atomic_write(
        args.out / "longppl.md", lambda tmp: tmp.write_text(markdown(classes, points, correlations, table))
    )
    print(markdown(classes, points, correlations, table))
    return dict(tokens=tokens, points=points, classes=classes, variants=table, correlations=correlations)


if __name__ == "__main__":
    main()
