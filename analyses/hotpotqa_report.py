"""The HotpotQA study's numbers, from its files (``figures/studies/hotpotqa_protocol.md``): the folder of
the protocol's natural-length command for each model (:func:`study_folder_of`; other studies of HotpotQA,
such as the faithful default's judged run, have folders of their own), finished or still running (its
finished parts).

Per model: the questions done of those planned, the explained answers' exact match and token F1; per
model and scorer: LDS, its paired difference from exhaustive leave-one-out with a 95 % bootstrap interval,
the AOPC of comprehensiveness, and the plausibility against the gold supporting sentences (sentence
AUROC, recall of the gold sentences in the top 2). Writes ``figures/studies/hotpotqa_summary.csv`` and the
table between the ``hotpotqa`` markers of RESULTS.md, so that the report quotes the files. Beside it, each
model's own answers to all 32 questions, measured ahead of the detectors (:data:`ACCURACY`, written by
``analyses.task_accuracy``, the same greedy answers), and on how many of the questions done the study's
explained answer is the same one. The public packages scored on a model's questions once its part has
finished (the protocol's amendment: ``PEERS/hotpotqa-MODEL/``, judged on the study's own masked passes)
join its scorers (:func:`peer_rows`).

    python -m analyses.hotpotqa_report
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from probe import stats
from probe.atomic import atomic_write

from . import detector_compare
from .claims import update_results
from .peers.exchange import key_fields
from .study_files import folder_rows
from .task_accuracy import read_results

MARKERS = "<!-- hotpotqa:start -->", "<!-- hotpotqa:end -->"
PUBLIC = "context-cite 0.0.4"  # the public package's row name in a peers run
SHOWN = ("leave_one_out", "context_cite", PUBLIC, "key_removal_banzhaf", "attn_lrp", "lexical_overlap")
MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
#: the protocol's natural-length command; ``qwen2.5-coder-1.5b`` runs it without ``at2`` (no head weights)
NATURAL = (
    "--tasks hotpotqa --length natural --samples 32 --seed 0 --loo-top-m all --ks 1 2 4 8 --masks 32 "
    "--detectors attention fr embedding_grad information_flow grad_times_input key_removal_grad "
    "key_removal_banzhaf at2 attn_lrp integrated_gradients lsd random recency lexical_overlap leave_one_out "
    "context_cite"
)
#: the study's first questions explained again with the gold answer, teacher-forced (gold vs own)
GOLD = (
    "--tasks hotpotqa --length natural --samples 8 --seed 0 --explain gold --loo-top-m all --ks 1 2 4 8 "
    "--masks 32 --detectors key_removal_grad information_flow key_removal_banzhaf attn_lrp lexical_overlap "
    "leave_one_out context_cite"
)
#: the held-out study's folder (generated tasks, gold answers; figures/studies/heldout_protocol.md)
HELD_OUT = {"smollm2-135m": "detector_smollm2-135m-1024_faffad12"}
ANSWER_MARKERS = "<!-- answers:start -->", "<!-- answers:end -->"
ACCURACY_MARKERS = "<!-- hotpotqa-accuracy:start -->", "<!-- hotpotqa-accuracy:end -->"
#: the four models' answers to the study's questions (``python -m analyses.task_accuracy --tasks hotpotqa
#: --lengths natural --samples 32 --out figures/studies/hotpotqa_accuracy``)
ACCURACY = Path("studies") / "hotpotqa_accuracy" / "task_accuracy.csv"
#: the peers runs on the study's questions: hotpotqa-MODEL/peers.csv (``analyses.peers.compare``)
PEERS = Path("bench/results/peers")


def study_folder_of(model: str, figures: Path = Path("figures"), command: str | None = None) -> Path:
    """The folder ``command`` writes for ``model``; by default the study's natural-length command
    (:data:`NATURAL`, without ``at2`` for ``qwen2.5-coder-1.5b``)."""
    if command is None:
        command = NATURAL.replace(" at2 ", " ") if model == "qwen2.5-coder-1.5b" else NATURAL
    return detector_compare.command_folder(model, command, figures)


def study_rows(
    figures: Path, models: tuple[str, ...] = MODELS
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, int]]:
    """(metrics rows, faithfulness rows, questions planned per model) of the study's folders."""
    metrics, faithful, planned = [], [], {}
    for model in models:
        found_metrics, found_faithful, planned_here = folder_rows(study_folder_of(model, figures))
        if planned_here:
            planned[model] = planned_here
        if not found_faithful.empty:
            metrics.append(found_metrics)
            faithful.append(found_faithful)
    if not faithful:
        return pd.DataFrame(), pd.DataFrame(), planned
    return pd.concat(metrics, ignore_index=True), pd.concat(faithful, ignore_index=True), planned


def peer_rows(peers: Path, models: tuple[str, ...] = MODELS) -> pd.DataFrame:
    """The public packages' faithfulness rows on the study's questions, as the study's own rows (model, task,
    seed, scorer, lds, aopc_comprehensiveness), for each model whose peers run has finished
    (``peers/hotpotqa-MODEL/peers.csv``; its own detectors' rows are left out: the study has them)."""
    found = []
    for model in models:
        path = peers / f"hotpotqa-{model}" / "peers.csv"
        if path.exists():
            table = pd.read_csv(path)
            table = table[table.source == "peer"].reset_index(drop=True)
            fields = table["sample"].map(key_fields)  # (task, length, seed)
            found.append(table.assign(model=model, task=fields.str[0], seed=fields.str[2]))
    columns = ["model", "task", "seed", "scorer", "lds", "aopc_comprehensiveness"]
    return pd.concat(found, ignore_index=True)[columns] if found else pd.DataFrame(columns=columns)


def paired_to_reference(faithful: pd.DataFrame, scorer: str) -> pd.Series:
    """Per sample (task, seed): ``scorer``'s LDS minus exhaustive leave-one-out's."""
    wide = faithful.pivot_table(index=["task", "seed"], columns="scorer", values="lds")
    return (wide[scorer] - wide["leave_one_out"]).dropna()


def answers_and_text(figures: Path, model: str = "smollm2-135m") -> pd.DataFrame:
    """How a verdict (LDS − exhaustive leave-one-out's, paired, 95 % bootstrap interval) moves between
    planted and real text and between the gold answer and the model's own: the held-out study
    (:data:`HELD_OUT`: generated tasks, gold answers), HotpotQA questions explained with the gold answer
    (:data:`GOLD`) and the same questions in the study (the model's own answers), and the own − gold shift
    paired by question. One row per scorer the three share."""
    planted = folder_rows(figures / "studies" / HELD_OUT[model])[1]
    gold = folder_rows(study_folder_of(model, figures, GOLD))[1]
    own = folder_rows(study_folder_of(model, figures))[1]
    if gold.empty or own.empty:
        return pd.DataFrame()
    rows = []
    for scorer in sorted(set(planted.scorer) & set(gold.scorer) & set(own.scorer) - {"leave_one_out"}):
        found = {name: paired_to_reference(table, scorer) for name, table in
                 (("planted_gold", planted), ("real_gold", gold), ("real_own", own))}  # fmt: skip
        found["own_minus_gold"] = (found["real_own"] - found["real_gold"]).dropna()
        row = {"model": model, "scorer": scorer}
        for name, values in found.items():
            estimate = stats.bootstrap(values.to_numpy())
            row |= {name: estimate.value, f"{name}_low": estimate.low, f"{name}_high": estimate.high,
                    f"{name}_n": estimate.n}  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows)


def answers_markdown(table: pd.DataFrame) -> str:
    """:func:`answers_and_text`'s table."""
    if table.empty:
        return "Running: the gold-answer questions have not finished."
    columns = ("planted_gold", "real_gold", "real_own", "own_minus_gold")
    first = table.iloc[0]
    lines = [
        f"| scorer ({first.model}) | planted text, gold answer ({first.planted_gold_n}) "
        f"| real questions, gold answer ({first.real_gold_n}) "
        f"| the same questions, its own answer ({first.real_own_n}) | own − gold, paired |",
        "|---|---|---|---|---|",
    ]
    for row in table.itertuples():
        cells = [stats.row_interval(row, column, signed=True) for column in columns]
        lines.append("| " + " | ".join([f"`{row.scorer}`", *cells]) + " |")
    return "\n".join(lines)


def summary(metrics: pd.DataFrame, faithful: pd.DataFrame) -> pd.DataFrame:
    """One row per model and scorer (see the module docstring)."""
    rows = []
    for model, part in faithful.groupby("model"):
        wide = part.pivot_table(index="seed", columns="scorer", values="lds")
        answers = metrics[metrics.model == model].drop_duplicates("seed")
        right = answers.set_index("seed").exact_match.reindex(wide.index) == 1
        for scorer, scored in part.groupby("scorer"):
            plausible = metrics[(metrics.model == model) & (metrics.detector == scorer)]
            difference = wide[scorer] - wide["leave_one_out"]
            paired = stats.bootstrap(difference.dropna().to_numpy())
            row = {
                "model": model, "scorer": scorer, "questions": len(answers),
                "exact_match": answers.exact_match.mean(), "f1": answers.f1.mean(),
                "lds": scored.lds.mean(), "lds_minus_loo": paired.value,
                "low": paired.low, "high": paired.high,
                "aopc_comprehensiveness": scored.aopc_comprehensiveness.mean(),
                "source_auroc": plausible.source_auroc.mean(),
                "recall_top2": plausible.recall_top2_sources.mean(),
            }  # fmt: skip
            for name, chosen in (("correct", right), ("wrong", ~right)):
                values = difference[chosen].dropna().to_numpy()
                apart = stats.bootstrap(values) if len(values) else stats.Estimate(*[float("nan")] * 3, 0)
                row |= {name: apart.value, f"{name}_low": apart.low, f"{name}_high": apart.high,
                        f"{name}_n": int(chosen.sum())}  # fmt: skip
            rows.append(row)
    return pd.DataFrame(rows)


def split_markdown(table: pd.DataFrame) -> str:
    """LDS − leave-one-out's (paired, 95 % interval) of the :data:`SHOWN` scorers on the questions a model
    answered correctly (exact match) and on those it answered wrongly, apart."""
    lines = [
        "| model | scorer | answered correctly: LDS − leave-one-out | answered wrongly |",
        "|---|---|---|---|",
    ]
    for model, part in table.groupby("model"):
        first = part.iloc[0]
        head = [f"{model} ({first.correct_n} / {first.wrong_n})"]
        for scorer in [name for name in SHOWN if name in set(part.scorer) and name != "leave_one_out"]:
            row = part[part.scorer == scorer].iloc[0]
            cells = [stats.row_interval(row, name, signed=True) for name in ("correct", "wrong")]
            lines.append("| " + " | ".join([*head, f"`{scorer}`", *cells]) + " |")
            head = [""]
    return "\n".join(lines)


def markdown(table: pd.DataFrame, planned: dict[str, int]) -> str:
    """The report's table: per model, its answers, then the :data:`SHOWN` scorers."""
    if table.empty:
        return "Running: no question finished yet."
    lines = [
        "| model | questions (of planned) | exact match / F1 of its answers | scorer | LDS | − leave-one-out "
        "[95 % CI] | recall of gold sentences in top 2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, part in table.groupby("model"):
        first = part.iloc[0]
        about = [
            model,
            f"{first.questions} ({planned.get(model, '?')})",
            f"{first.exact_match:.2f} / {first.f1:.2f}",
        ]
        for scorer in [name for name in SHOWN if name in set(part.scorer)]:
            row = part[part.scorer == scorer].iloc[0]
            paired = stats.interval_text(row.lds_minus_loo, row.low, row.high)
            interval = "–" if scorer == "leave_one_out" else paired
            cells = [*about, f"`{scorer}`", f"{row.lds:.2f}", interval, stats.number_text(row.recall_top2)]
            lines.append("| " + " | ".join(cells) + " |")
            about = ["", "", ""]
    done = ", ".join(f"{model} {n}" for model, n in table.groupby("model").questions.first().items())
    return (
        "\n".join(lines)
        + f"\n\nQuestions done so far: {done}; a running study's intervals are provisional. The same "
        "differences on the questions each model answered correctly and wrongly (exact match; their numbers "
        f"in brackets; – where none):\n\n{split_markdown(table)}"
    )


def answer_accuracy(figures: Path, metrics: pd.DataFrame) -> pd.DataFrame:
    """Per model: its answers to the study's questions (:data:`ACCURACY`): questions, exact match, token F1,
    and, over the questions the study has done, how many of its explained answers have the same exact
    match and F1 (``agree`` of ``done``)."""
    path = figures / ACCURACY
    if not path.exists():
        return pd.DataFrame()
    answers = read_results(path)
    answers = answers[(answers.task == "hotpotqa") & (answers.length == "natural")]
    explained = metrics.drop_duplicates(["model", "seed"]) if not metrics.empty else pd.DataFrame()
    rows = []
    for model, part in answers.groupby("model", sort=False):
        row = {
            "model": model,
            "questions": len(part),
            "exact_match": part.exact_match.mean(),
            "f1": part.f1.mean(),
        }
        if not explained.empty:
            both = part.merge(explained[explained.model == model], on="seed", suffixes=("", "_study"))
            same = (both.exact_match == both.exact_match_study) & (both.f1 - both.f1_study).abs().le(1e-9)
            row |= {"done": len(both), "agree": int(same.sum())}
        rows.append(row)
    return pd.DataFrame(rows).reindex(columns=["model", "questions", "exact_match", "f1", "done", "agree"])


def accuracy_markdown(table: pd.DataFrame) -> str:
    """:func:`answer_accuracy`'s table."""
    if table.empty:
        return "Not measured yet."
    lines = [
        "| model | questions | exact match | token F1 | the study's explained answers, the same |",
        "|---|---|---|---|---|",
    ]
    for row in table.itertuples():
        same = "–" if pd.isna(row.done) or not row.done else f"{row.agree:.0f} of {row.done:.0f}"
        lines.append(f"| {row.model} | {row.questions} | {row.exact_match:.2f} | {row.f1:.2f} | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--figures", type=Path, default=Path("figures"))
    parser.add_argument("--results", default="RESULTS.md", help="file with the hotpotqa markers ('' to skip)")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--peers", type=Path, default=PEERS, help="the peers runs' folder (PEERS)")
    args = parser.parse_args(argv)
    metrics, faithful, planned = study_rows(args.figures, tuple(args.models))
    public = peer_rows(args.peers, tuple(args.models))
    if not public.empty and not faithful.empty:
        faithful = pd.concat([faithful, public[public.model.isin(set(faithful.model))]], ignore_index=True)
    table = summary(metrics, faithful) if not faithful.empty else pd.DataFrame()
    atomic_write(
        args.figures / "studies" / "hotpotqa_summary.csv", lambda tmp: table.to_csv(tmp, index=False)
    )
    shift = answers_and_text(args.figures)
    atomic_write(
        args.figures / "studies" / "hotpotqa_gold_vs_own.csv", lambda tmp: shift.to_csv(tmp, index=False)
    )
    accuracy = answer_accuracy(args.figures, metrics)
    if args.results:
        update_results(Path(args.results), markdown(table, planned), MARKERS)
        update_results(Path(args.results), answers_markdown(shift), ANSWER_MARKERS)
        update_results(Path(args.results), accuracy_markdown(accuracy), ACCURACY_MARKERS)
    print(markdown(table, planned), answers_markdown(shift), accuracy_markdown(accuracy), sep="\n\n")
    return table


if __name__ == "__main__":
    main()
