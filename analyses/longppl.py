"""LongPPL at small scale on the real models (Fang et al. 2025, §2 and §4.1), with ``probe.probes.lsd``.

1. **Answer tokens** (§2.1–2.2, Figs. 2–4). LongEval ``lines`` samples (full record, gold answer
   teacher-forced, the asked line in the first 60 % so it sits more than K tokens back) at several
   prompt lengths. For the tokens of the question and the answer (the prefix "The <REGISTER_CONTENT>
   in line … is" and the number): LSD and LCL (eqs. 2–3); per (model, length) the accuracy (every
   answer token is the greedy prediction) against the PPL of answer and of non-answer tokens; and
   how well LSD > α alone and LSD > α and LCL > β classify answer vs non-answer tokens (paper:
   85.6 % / 98.2 %).
2. **LongPPL vs PPL as predictors** (§4.1, Table 1, Fig. 1b). A variant is a model (SmolLM2, Gemma 3)
   with attention limited to the last W tokens (:func:`probe.attention_window`), or at full
   attention with its RoPE base times a factor (:func:`probe.rope_base`; Gemma 3: the global layers'
   base). Each gets PPL (eq. 1), LongPPL and LongPPL-soft (eqs. 4, 7) on Paul Graham essay text
   (:func:`probe.tasks.noise.essay_documents`), key tokens chosen once by a fixed evaluator (full
   Gemma 3; SmolLM2's tokens are aligned by characters, App. A.1 eqs. 9–10), pooled per token over
   the documents (:func:`probe.probes.lsd.pool_longppl`), and teacher-forced accuracy on the tasks at the
   same length. Pearson (of the log, the mean NLL) and Spearman r of each measure with the mean
   accuracy across variants, each with a 95 % bootstrap interval over variants
   (:func:`probe.stats.correlation`).

K and d: ``--K`` / ``--d`` tokens (default 128 / 128; our models are small and slow on CPU), or with
``--K-ratio`` the paper's proportions at every length: K = 4096 and d = 1024 on ≈ 32K-token texts
(§4.1, App. A.1), so K = length / 8 and d = K / 4 (K = 256, d = 64 at 2K tokens).

    python -m analyses.longppl                  # quick: ~5 min on 2 idle cores
    python -m analyses.longppl --claims         # 12 variants, 3 tasks × 20 samples at 2K: ≈ 7.5 h, 1 thread
    python -m analyses.longppl --claims-cpu     # the same 12 variants and 3 tasks: ≈ 70 min, 1 thread
    python -m analyses.longppl --claims --task-samples 8     # a preset's values are defaults: options win
    accelerate launch --multi_gpu --num_processes 2 -m analyses.longppl --claims --resume
    accelerate launch --multi_gpu --num_processes 2 -m analyses.longppl --claims-cpu --task-samples 20
                                                # the committed figures: 60 min, 2 processes, shared

``--claims``: both models as variants with W = 64, 256, 1024, full and, at full attention, RoPE base
× 0.1 and × 0.01 (12 variants); passkey, niah and multihop-1 at 2048 tokens, 20 samples each;
8 documents; answer tokens of both models at 2K, 4K and 8K tokens, 20 samples each; K at the paper's
ratio. ``--claims-cpu``: the same variants, tasks and ratio with 4 samples per task, 2 documents and
answer tokens at 2K only, 4 samples per model: the most that fits 75 min on one CPU thread, from
forwards at 2K tokens of ≈ 20 s (SmolLM2; Gemma 3 scoring a few rows) and ≈ 45 s (Gemma 3 scoring
every token: its 262K-token vocabulary) on a shared 2-core machine. Every probe here is a forward
pass without gradients, so no length needs checkpointing.

Runs as sweeps (:mod:`analyses.sweep`), unchanged under ``accelerate launch``: the evaluator's key
tokens (one job per document; the main process hands them to every process), then one job per
(variant, document), per (variant, task, sample) and per answer-token sample. Each finished job is
kept in ``OUT/.longppl_parts``, all of them in one file once the outputs are written
(:func:`analyses.sweep.finish`); ``--resume`` reads the finished ones back instead of running them again.

Writes ``figures/longppl_answer_ppl``, ``longppl_answer_lsd``, ``longppl_correlation`` (PNG + CSV),
``longppl_answer_tokens.csv`` (one row per token), ``longppl_correlation_table.csv`` (metric,
method, r, low, high, n) and ``longppl.md`` (the tables for RESULTS.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch
from accelerate.utils import broadcast_object_list

import probe
from probe import tasks
from probe.probes import logprobs, lsd
from probe.tasks.noise import essay_documents

from .arguments import add_device_arguments, check_device_arguments, check_out, load, resume_settings
from .longppl_tables import (
    answer_points,
    classification,
    correlation_table,
    markdown,
    plot_answer_lsd,
    plot_answer_ppl,
    plot_correlation,
)
from .output import atomic_write, save_figure
from .sweep import finish, sweep

NAME = "longppl"
MAX_DEPTH = 0.6  # the asked line / needle lies in the first 60 % of the context
PAPER_K_RATIO = 4096 / 32768  # K = 4096 on ≈ 32K-token texts (§4.1)
PAPER_D_PER_K = 1024 / 4096  # d = 1024 (App. A.1)

CLAIMS = dict(
    answer_models=["gemma3-270m", "smollm2-135m"],
    answer_lengths=[2048, 4096, 8000],  # 8K: SmolLM2 has 8192 positions, samples run ~1 % long
    answer_samples=20,
    k_ratio=PAPER_K_RATIO,
    variant_models=["smollm2-135m", "gemma3-270m"],
    windows=["64", "256", "1024", "full"],
    rope_factors=[1.0, 0.1, 0.01],
    length=2048,
    documents=8,
    tasks=["passkey", "niah", "multihop-1"],
    task_samples=20,
)
PRESETS = {
    "claims": CLAIMS,
    "claims_cpu": CLAIMS | dict(answer_lengths=[2048], answer_samples=4, documents=2, task_samples=4),
}


def sample_depth(seed: int) -> float:
    return float(np.random.default_rng(seed).uniform(0, MAX_DEPTH))


def short_windows(args: argparse.Namespace, length: int) -> tuple[int, int]:
    """(K, d) at ``length`` tokens: the paper's proportions with ``--K-ratio``, else ``--K``, ``--d``."""
    if args.k_ratio is None:
        return args.K, args.d
    K = round(args.k_ratio * length)
    return K, max(1, round(K * PAPER_D_PER_K))


class Variant(NamedTuple):
    """A model with attention limited to its last ``window`` tokens (``None``: full) and its RoPE base
    times ``rope_factor``."""

    model: str
    window: int | None
    rope_factor: float

    @property
    def setting(self) -> str:
        window = f"W={'full' if self.window is None else self.window}"
        return window if self.rope_factor == 1 else f"{window}, RoPE base ×{self.rope_factor:g}"

    @property
    def name(self) -> str:
        return f"{Path(self.model).name} {self.setting}"

    @contextmanager
    def applied(self, model) -> Iterator[None]:
        with probe.attention_window(model, self.window), probe.rope_base(model, self.rope_factor):
            yield

    def frame(self, **columns) -> pd.DataFrame:
        """One row: the variant's name, model, window, RoPE factor, then ``columns``."""
        window = "full" if self.window is None else str(self.window)
        identity = dict(variant=self.name, model=Path(self.model).name, window=window)
        return pd.DataFrame([identity | dict(rope_factor=self.rope_factor, setting=self.setting) | columns])


def variants_of(args: argparse.Namespace) -> list[Variant]:
    """Each model with each window, then at full attention with each RoPE base factor (repeats once)."""
    changes = [(window, 1.0) for window in args.windows] + [(None, factor) for factor in args.rope_factors]
    return list(dict.fromkeys(Variant(m, w, f) for m in args.variant_models for w, f in changes))


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
            "K": K,
            "d": d,
            "position": target_positions.numpy(),
            "kind": np.where(target_positions >= answer_start, "answer", "non-answer"),
            "lsd": (long.target - short.target)[target_positions].numpy(),
            "lcl": long.target[target_positions].numpy(),
            "greedy": long.greedy[target_positions].numpy(),
        }
    )


def sample_correct(model, tokenizer, task: str, length: int, seed: int) -> bool:
    """Teacher-forced exact match of one sample: every answer token is the greedy prediction."""
    sample = tasks.make(task, tokenizer, length, seed=seed, depth=sample_depth(seed))
    (start, end), *_ = sample.spans["answer"]
    scores = logprobs.long_logprobs(model, sample.input_ids, range(start, end))
    return bool(scores.greedy[start:end].all())


def variant_table(variants: list[Variant], documents: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """One row per variant: PPL, LongPPL, LongPPL-soft pooled over the documents, accuracy per task and
    their mean."""
    pooled = {name: lsd.pool_longppl(list(group.result)) for name, group in documents.groupby("variant")}
    accuracy = samples.pivot_table(index="variant", columns="task", values="correct", aggfunc="mean")
    task_names = list(dict.fromkeys(samples.task))
    frames = []
    for variant in variants:
        scores, correct = pooled[variant.name], accuracy.loc[variant.name, task_names]
        frames.append(
            variant.frame(
                ppl=scores.ppl,
                longppl=scores.longppl,
                longppl_soft=scores.longppl_soft,
                n_key_tokens=scores.n_key_tokens,
                n_tokens=scores.n_tokens,
                **{f"accuracy_{task}": value for task, value in correct.items()},
                accuracy=correct.mean(),
            )
        )
    return pd.concat(frames, ignore_index=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    presets = parser.add_mutually_exclusive_group()
    presets.add_argument("--claims", action="store_true", help="the claims run (see the module docstring)")
    presets.add_argument(
        "--claims-cpu", action="store_true", help="the claims run in ≈ 70 min on 1 CPU thread"
    )
    parser.add_argument("--K", type=int, default=128, help="short context (tokens)")
    parser.add_argument("--d", type=int, default=128, help="tokens sharing one short-context window")
    parser.add_argument(
        "--K-ratio",
        dest="k_ratio",
        type=float,
        help=f"K = ratio × length, d = K / 4 (paper: {PAPER_K_RATIO})",
    )
    parser.add_argument("--alpha", type=float, default=2.0)
    parser.add_argument("--beta", type=float, default=-2.0)
    parser.add_argument("--answer-models", nargs="+", default=["gemma3-270m"])
    parser.add_argument("--answer-lengths", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--answer-samples", type=int, default=4, help="samples per (model, length)")
    parser.add_argument("--evaluator", default="gemma3-270m", help="the model that picks the key tokens")
    parser.add_argument("--variant-models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--windows", nargs="+", default=["64", "256", "full"], help="attention windows")
    parser.add_argument(
        "--rope-factors", type=float, nargs="+", default=[1.0], help="RoPE base factors, at full attention"
    )
    parser.add_argument("--length", type=int, default=768, help="essay / task length for the variants")
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--tasks", nargs="+", default=["passkey"], choices=tasks.names())
    parser.add_argument("--task-samples", type=int, default=5, help="samples per (variant, task)")
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.add_argument("--resume", action="store_true", help="keep the jobs a killed run finished")
    args = parser.parse_args(argv)
    for preset, defaults in PRESETS.items():
        if getattr(args, preset):  # the preset's values become defaults: options given explicitly win
            parser.set_defaults(**defaults)
            args = parser.parse_args(argv)
    if any(w != "full" and not (w.isdigit() and int(w) > 0) for w in args.windows):
        parser.error(f"--windows takes positive token counts or 'full', got {args.windows}")
    args.windows = [None if w == "full" else int(w) for w in args.windows]
    if min(args.rope_factors) <= 0:
        parser.error("--rope-factors must be positive")
    if args.k_ratio is not None and not 0 < args.k_ratio <= 1 - MAX_DEPTH:
        parser.error(f"--K-ratio must lie in (0, {1 - MAX_DEPTH:g}]: the asked line sits that far back")
    if min(args.documents, args.task_samples, args.answer_samples) < 1:
        parser.error("--documents, --task-samples and --answer-samples must be at least 1")
    if len(variants_of(args)) < 3:
        parser.error("the correlations need at least 3 variants")
    check_out(parser, args.out)
    check_device_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> dict[str, pd.DataFrame]:
    """Run the sweeps and write the outputs; the main process returns the tables (others ``{}``)."""
    args = parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    loaded: dict[str, tuple] = {}

    def model(name: str) -> tuple:
        if name not in loaded:
            loaded[name] = load(args, name)
        return loaded[name]

    parts, (K, d) = args.out / f".{NAME}_parts", short_windows(args, args.length)
    texts = essay_documents(model(args.evaluator)[1], args.length, args.documents)

    def key_tokens(job: tuple) -> dict[str, pd.DataFrame]:
        _, index = job
        chosen = lsd.find_key_tokens(texts[index], *model(args.evaluator), K, d, args.alpha, args.beta)
        return {"keys": pd.DataFrame({"document": [index], "key_tokens": [chosen]})}

    # computed once, one job per document; every process needs them all: the main process sends them
    found = sweep(
        [("keys", i) for i in range(len(texts))],
        key_tokens,
        parts,
        args.resume,
        "key tokens",
        settings=resume_settings(args),
    )
    (keys,) = broadcast_object_list([None if found is None else list(found["keys"].key_tokens)])

    def document(job: tuple) -> dict[str, pd.DataFrame]:
        _, name, window, factor, index = job
        variant, (net, tokenizer) = Variant(name, window, factor), model(name)
        with variant.applied(net):
            result = lsd.longppl(keys[index].text, net, tokenizer, key_tokens=keys[index])
        return {"documents": variant.frame(document=index, result=result)}

    def sample(job: tuple) -> dict[str, pd.DataFrame]:
        _, name, window, factor, task, seed = job
        variant, (net, tokenizer) = Variant(name, window, factor), model(name)
        with variant.applied(net):
            correct = sample_correct(net, tokenizer, task, args.length, seed)
        return {"samples": variant.frame(task=task, seed=seed, correct=float(correct))}

    def answer(job: tuple) -> dict[str, pd.DataFrame]:
        _, name, length, seed = job
        rows = answer_token_rows(*model(name), Path(name).name, length, seed, *short_windows(args, length))
        return {"tokens": rows}

    variants = variants_of(args)
    documents = sweep(
        [("document", *v, i) for v in variants for i in range(len(texts))],
        document,
        parts,
        args.resume,
        "documents",
        settings=resume_settings(args),
    )
    samples = sweep(
        [("task", *v, t, s) for v in variants for t in args.tasks for s in range(args.task_samples)],
        sample,
        parts,
        args.resume,
        "task samples",
        settings=resume_settings(args),
    )
    answers = sweep(
        [
            ("answer", m, n, s)
            for m in args.answer_models
            for n in args.answer_lengths
            for s in range(args.answer_samples)
        ],
        answer,
        parts,
        args.resume,
        "answer tokens",
        settings=resume_settings(args),
    )
    if answers is None:  # not the main process of an accelerate launch: it writes the outputs
        return {}

    tokens = answers["tokens"]
    points, classes = answer_points(tokens), classification(tokens, args.alpha, args.beta)
    table = variant_table(variants, documents["documents"], samples["samples"])
    correlations = correlation_table(table)
    answer_K = f"length / {1 / args.k_ratio:g}" if args.k_ratio else str(args.K)
    settings = (
        f"{len(variants)} variants; essay text and tasks at {args.length} tokens; documents: {len(texts)} "
        f"(evaluator {Path(args.evaluator).name}, K = {K}, d = {d}, α = {args.alpha}, β = {args.beta}); "
        f"samples per task: {args.task_samples}; answer tokens: samples per (model, length): "
        f"{args.answer_samples}, K = {answer_K}."
    )
    report = markdown(settings, classes, points, correlations, table)
    atomic_write(args.out / f"{NAME}_answer_tokens.csv", lambda tmp: tokens.to_csv(tmp, index=False))
    save_figure(plot_answer_ppl(points), points, args.out, f"{NAME}_answer_ppl")
    save_figure(plot_answer_lsd(tokens, args.alpha, args.beta), classes, args.out, f"{NAME}_answer_lsd")
    save_figure(plot_correlation(table, correlations), table, args.out, f"{NAME}_correlation")
    atomic_write(
        args.out / f"{NAME}_correlation_table.csv", lambda tmp: correlations.to_csv(tmp, index=False)
    )
    atomic_write(args.out / f"{NAME}.md", lambda tmp: tmp.write_text(report))
    finish(parts)  # every output is written: a --resume now runs nothing
    print(report)
    return dict(tokens=tokens, points=points, classes=classes, variants=table, correlations=correlations)


if __name__ == "__main__":
    main()
