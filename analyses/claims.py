"""The papers' claims, each with the paper's number, ours with a 95 % bootstrap interval, and a verdict.

Every row is computed from the per-study CSVs the analyses committed under ``figures/`` (nothing is
typed in by hand but the paper's number): ``python -m analyses.claims`` rewrites ``claims.csv`` and
the table between the ``<!-- claims -->`` markers of RESULTS.md. A study whose CSV is missing gives
a row that says so. Verdicts follow one rule (:func:`verdict`): *reproduced* when the interval lies
on the paper's side of the null value (and, for a magnitude, covers the paper's number or exceeds
it), *partly* when it does but stays short of the paper's magnitude, *not reproduced* when it lies
on the other side, *inconclusive* when it covers the null value. Claims no experiment of ours can
test at this scale are listed as *not testable*, with the reason.

    python -m analyses.claims                  # figures/claims.csv + the table in RESULTS.md
    python -m analyses.claims --figures DIR --results RESULTS.md
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import pearsonr

from probe.atomic import atomic_write
from probe.stats import MIN_UNITS, Estimate, bootstrap, correlation, difference

from . import longppl
from .length_ranking import faithfulness_rows, ranking_by_length, ranking_markdown

START, END = "<!-- claims:start -->", "<!-- claims:end -->"
LENGTHS = "<!-- lengths:start -->", "<!-- lengths:end -->"


@dataclass(frozen=True)
class Measured:
    """What one claim's experiment gave: our estimate, the setting it ran at, and the comparison."""

    estimate: Estimate | None
    setting: str
    direction: int = 1  # the sign the paper's effect has (+1: ours must exceed `null`; −1: fall below)
    null: float = 0.0
    magnitude: float | None = None  # the paper's size of the effect, where it gives one
    note: str = ""
    effect: bool = True  # False: the paper claims there is *no* effect (reproduced if we find none)
    ran: bool = True  # False: the study's CSV (or this case of it) is not there


@dataclass(frozen=True)
class Claim:
    """A claim of a seed paper: where it is, what it says, the paper's number, and how we measure it."""

    key: str
    seed: str
    statement: str
    paper: str
    measure: Callable[[Path], Measured]


def verdict(measured: Measured) -> str:
    """reproduced / partly / not reproduced / inconclusive / not testable / not run (see the module doc)."""
    estimate = measured.estimate
    if estimate is None:
        return "not testable" if measured.ran else "not run"
    if np.isnan(estimate.low):
        return f"inconclusive (fewer than {MIN_UNITS} units, no interval)"
    low, high = sorted(measured.direction * (np.array([estimate.low, estimate.high]) - measured.null))
    if not measured.effect:
        return "reproduced (no effect)" if low <= 0 <= high else "not reproduced (an effect)"
    if low > 0:
        if measured.magnitude is None:
            return "reproduced"
        paper = measured.direction * (measured.magnitude - measured.null)
        return "reproduced" if high >= paper else "partly (smaller than the paper's)"
    return "not reproduced" if high < 0 else "inconclusive (interval covers no effect)"


def csv(figures: Path, name: str) -> pd.DataFrame:
    path = figures / name
    if not path.exists():
        raise FileNotFoundError(f"{name} is missing: run the study that writes it first")
    return pd.read_csv(path)


# --- LongPPL (Fang et al. 2025) -----------------------------------------------------------------------------


def answer_token_rules(figures: Path) -> Measured:
    tokens = csv(figures, "longppl_answer_tokens.csv").dropna(subset=["lsd"])
    defaults = longppl.parse_args([])
    alpha, beta = defaults.alpha, defaults.beta
    truth = tokens.kind == "answer"
    lsd_only = (tokens.lsd > alpha) == truth
    both = ((tokens.lsd > alpha) & (tokens.lcl > beta)) == truth
    per_sample = (
        tokens.assign(lsd_only=lsd_only, both=both)
        .groupby(["model", "length", "seed"])[["lsd_only", "both"]]
        .agg(["sum", "count"])
    )
    gain = bootstrap(
        per_sample["both", "sum"],
        per_sample["lsd_only", "sum"],
        per_sample["both", "count"],
        statistic=lambda b, a, n: (b.sum() - a.sum()) / n.sum(),
        over="samples",
    )
    models = ", ".join(sorted(tokens.model.unique()))
    lengths = "/".join(str(n) for n in sorted(tokens.length.unique()))
    return Measured(gain, f"{models}; LongEval lines at {lengths} tokens", magnitude=0.126)


def longppl_correlation(metric: str) -> Callable[[Path], Measured]:
    def measure(figures: Path) -> Measured:
        variants = csv(figures, "longppl_correlation.csv")
        r = correlation(np.log(variants[metric]), variants.accuracy, "pearson", over="variants")
        setting = f"{len(variants)} variants ({', '.join(sorted(variants.model.unique()))}); log {metric}"
        if metric == "ppl":  # the paper: PPL shows no correlation
            return Measured(r, setting, effect=False)
        return Measured(r, setting, direction=-1, magnitude=-0.96)

    return measure


def longppl_beats_ppl(figures: Path) -> Measured:
    """abs r(LongPPL, accuracy) − abs r(PPL, accuracy), variants resampled together."""
    variants = csv(figures, "longppl_correlation.csv")
    columns = np.log(variants.longppl), np.log(variants.ppl), variants.accuracy

    def advantage(longppl: np.ndarray, ppl: np.ndarray, accuracy: np.ndarray) -> float:
        if np.ptp(accuracy) == 0:
            return np.nan
        return abs(pearsonr(longppl, accuracy).statistic) - abs(pearsonr(ppl, accuracy).statistic)

    estimate = bootstrap(*columns, statistic=advantage, over="variants")
    return Measured(estimate, f"{len(variants)} variants; abs(Pearson r) with mean accuracy, log scales")


# --- CDT (Context Denoising Training) ---------------------------------------------------------------------


def detector_advantage(
    better: str, worse: str, length: int, on: str = "multi-hop", column: str = "aopc_comprehensiveness"
) -> Callable[[Path], Measured]:
    """``better`` − ``worse`` in ``column`` over the detector-comparison samples at ``length`` tokens on
    the task set ``on`` (a :data:`~analyses.length_ranking.TASK_SETS` name)."""

    def measure(figures: Path) -> Measured:
        rows = faithfulness_rows(figures)
        rows = rows[(rows.length == length) & (rows.tasks == on)]
        if rows.empty:
            raise LookupError(f"no detector comparison at {length} tokens on the {on} tasks")
        table = rows.pivot_table(index=["model", "task", "seed"], columns="scorer", values=column)
        difference = bootstrap(table[better] - table[worse], over="samples")
        models = ", ".join(sorted(rows.model.unique()))
        setting = f"{models}; {len(table)} {on} samples at {length // 1024}K; {column}"
        running = rows[rows.running].drop_duplicates("model")
        note = ", ".join(
            f"{row.model} still running, {row.planned} samples planned" for row in running.itertuples()
        )
        return Measured(difference, setting, note=note)

    return measure


def noise_restraint_gain(length: int) -> Callable[[Path], Measured]:
    """Attention on the supporting facts after / before (all layers, pooled over samples) at the best
    model and step, for prompts of about ``length`` tokens."""

    def measure(figures: Path) -> Measured:
        frames = [csv(figures, "noise_restraint.csv")]
        more = sorted(figures.glob("noise_restraint_*/noise_restraint.csv"))
        frames += [pd.read_csv(path) for path in more]
        rows = pd.concat(frames, ignore_index=True)
        rows = rows[2 ** np.round(np.log2(rows.length)) == length]  # prompt lengths vary a little by sample
        supporting = rows[rows.category == "supporting"]
        per_sample = supporting.groupby(["model", "step", "seed"])[["before", "after"]].sum()
        if per_sample.empty:
            raise LookupError(f"no noise-restraint run at {length} tokens")
        pooled = per_sample.groupby(["model", "step"]).sum()
        best_model, best_step = (pooled.after / pooled.before).idxmax()
        best = per_sample.loc[(best_model, best_step)]
        ratio = bootstrap(best.after, best.before, statistic=lambda a, b: a.sum() / b.sum(), over="samples")
        steps = ", ".join(f"{step:g}" for step in sorted(rows.step.unique()))
        setting = f"{best_model}, multi-hop at {length}, lr·β = {best_step:g} (best of {steps}), all layers"
        return Measured(ratio, setting, null=1.0, magnitude=10.0, note="ratio after / before")

    return measure


def objective_advantage(objective: str) -> Callable[[Path], Measured]:
    def measure(figures: Path) -> Measured:
        rows = csv(figures, "objectives.csv")
        if objective not in set(rows.objective):
            raise LookupError(f"{objective} is not in objectives.csv (the --claims run: ≈ 10–16 h here)")
        seed_column = "torch_seed"
        accuracy = rows.pivot_table(index=[seed_column, "seed"], columns="objective", values="correct")
        difference = bootstrap(accuracy[objective] - accuracy["ce"], over="held-out samples × seeds")
        first = rows.iloc[0]
        setting = (
            f"{first.model}, {first.task} at {first.length}, {first.steps} steps × {first.batch}, "
            f"{rows.seed.nunique()} held-out, {rows[seed_column].nunique()} seed(s)"
        )
        return Measured(difference, setting, note="greedy accuracy, minus CE's")

    return measure


# --- position bias (Wang et al., "Transformers Are Biased for Long-Context Modeling") -----------------------


def gap(panel: str, setting: str, pair: str, paper: float) -> Callable[[Path], Measured]:
    def measure(figures: Path) -> Measured:
        gaps = csv(figures, "position_bias_gaps.csv")
        ours = gaps[(gaps.source == "ours") & (gaps.panel == panel) & (gaps.setting == setting)]
        ours = ours[ours.pair == pair]
        estimate = bootstrap(ours.gap, over="seeds")
        return Measured(estimate, f"{panel}, {setting}, {pair}; {budget(ours)}", np.sign(paper), 0.0, paper)

    return measure


def gap_growth(panel: str, small: str, large: str, pair: str, paper: float) -> Callable[[Path], Measured]:
    def measure(figures: Path) -> Measured:
        gaps = csv(figures, "position_bias_gaps.csv")
        ours = gaps[(gaps.source == "ours") & (gaps.panel == panel) & (gaps.pair == pair)]
        by_seed = ours.pivot_table(index="seed", columns="setting", values="gap")
        estimate = bootstrap(by_seed[large] - by_seed[small], over="seeds")
        setting = f"{panel}, {pair}, {large} − {small}; {budget(ours)}"
        return Measured(estimate, setting, np.sign(paper), 0.0, paper)

    return measure


def budget(gaps: pd.DataFrame) -> str:
    """The training budget of the networks behind ``gaps`` (paper: 100,000 steps, 5 seeds)."""
    steps = f"{gaps.steps.iloc[0]:,.0f} steps" if "steps" in gaps else "steps not recorded"
    seeds = gaps.seed.nunique() if "seed" in gaps else "mean over the"
    return f"{steps} (paper 100,000), {seeds} seeds"


def lost_in_the_middle(figures: Path) -> Measured:
    rows = csv(figures, "position_bias_lost_in_the_middle.csv")
    rows = rows[rows.mix == "raw"].drop_duplicates(["model", "depth", "seed"])
    estimate = difference(rows[rows.depth.isin([0.0, 1.0])].correct, rows[rows.depth == 0.5].correct)
    models = ", ".join(sorted(rows.model.unique()))
    return Measured(estimate, f"{models}; kv retrieval, accuracy at the ends (depth 0, 1) − at depth 0.5")


# --- retrieval heads (Wu et al. 2024; LOGO, Tang et al. 2024, App. B) ---------------------------------------


def retrieval_head_ablation(figures: Path) -> Measured:
    rows = csv(figures, "retrieval_heads_ablation.csv")
    top = rows[rows.ablated == "retrieval heads"].groupby(["model", "task", "k"]).accuracy.mean()
    random = rows[rows.ablated == "random heads"].groupby(["model", "task", "k"]).accuracy.mean()
    difference = (random - top).dropna()
    estimate = bootstrap(difference.to_numpy(), over="(model, task, k) cells")
    return Measured(
        estimate, f"{len(difference)} cells, k = {sorted(difference.index.get_level_values('k').unique())}"
    )


def not_testable(reason: str) -> Callable[[Path], Measured]:
    return lambda figures: Measured(None, reason)


def detector_claims_at(length: int, on: str = "multi-hop") -> list[Claim]:
    """CDT §3.1 and §6.1 (the gradient and flow scores over attention and LSD) at ``length`` tokens on
    the task set ``on`` (a :data:`~analyses.length_ranking.TASK_SETS` name)."""
    k = f"{length // 1024}K"
    where = f"{k} tokens" if on == "multi-hop" else f"{k} on the {on} tasks"
    key = k.lower() if on == "multi-hop" else f"{k.lower()}_{on}"
    return [
        Claim(f"grad_vs_attention_{key}", "002 §3.1", f"… the same at {where}", "(as at 1K)",
              detector_advantage("embedding_grad", "attention", length, on)),
        Claim(f"flow_vs_attention_{key}", "002 §3.1, eq. 1", f"… information flow at {where}",
              "(as at 1K)", detector_advantage("information_flow", "attention", length, on)),
        Claim(f"grad_vs_lsd_{key}", "002 §6.1", f"… gradient over LSD at {where}", "(as at 1K)",
              detector_advantage("embedding_grad", "lsd", length, on)),
    ]  # fmt: skip


CLAIMS = [
    Claim("lsd_lcl", "000 §2.2, Fig. 4b", "LSD + LCL tells answer tokens apart better than LSD alone",
          "98.2 % vs 85.6 % (+12.6 points)", answer_token_rules),
    Claim("longppl_r", "000 §4.1, Fig. 1b", "LongPPL correlates negatively with long-context accuracy",
          "Pearson r = −0.96", longppl_correlation("longppl")),
    Claim("ppl_r", "000 §4.1, Fig. 1b", "PPL does not track long-context accuracy",
          "no correlation", longppl_correlation("ppl")),
    Claim("longppl_vs_ppl", "000 §4.1, Table 1", "LongPPL predicts long-context accuracy better than PPL",
          "r −0.96 vs none", longppl_beats_ppl),
    Claim("longce", "000 §5, Table 4", "Fine-tuning with LongCE beats CE on long-context tasks",
          "+ several points on LongBench / RULER", objective_advantage("longce")),
    Claim("grad_vs_attention", "002 §3.1", "Gradient-based critical tokens are more faithful than attention",
          "IG finds critical tokens attention misses",
          detector_advantage("embedding_grad", "attention", 1024)),
    Claim("flow_vs_attention", "002 §3.1, eq. 1", "Information flow is more faithful than attention",
          "(same claim, CDT's eq. 1 score)", detector_advantage("information_flow", "attention", 1024)),
    Claim("grad_vs_lsd", "002 §6.1", "Gradient scores beat LongPPL's LSD at finding critical tokens",
          "ordering gradient > attention > LongPPL", detector_advantage("embedding_grad", "lsd", 1024)),
    *(claim for length in (4096, 8192) for claim in detector_claims_at(length)),
    *(claim for length in (1024, 4096) for claim in detector_claims_at(length, "held-out")),
    Claim("noise_restraint", "002 §3.2, Fig. 4", "Moving noise embeddings against the gradient multiplies "
          "attention on critical tokens", "×10", noise_restraint_gain(1024)),
    Claim("noise_restraint_4k", "002 §3.2, Fig. 4", "… the same at 4K tokens", "×10",
          noise_restraint_gain(4096)),
    Claim("cdt", "002 §6, Table 1", "CDT fine-tuning beats plain SFT (CE)",
          "+2 to +3 points on LongBench-E", objective_advantage("cdt")),
    Claim("logo", "003 §4, Table 2", "LOGO preference training beats SFT", "+ several points on real tasks",
          objective_advantage("logo")),
    Claim("retrieval_heads", "003 App. B (Wu et al. 2024)", "Ablating retrieval heads breaks retrieval, as "
          "many random heads do not", "top heads: accuracy → ~0", retrieval_head_ablation),
    Claim("nope_first", "004 §5, Fig. 4", "Causal masking alone (No PE) favours the first position",
          "+0.077", gap("No PE", "depth 2", "first vs last", 0.077)),
    Claim("nope_depth", "004 §5, Fig. 4", "The No PE first-position bias grows with depth",
          "+0.029 (0.077 → 0.106, 2 → 6 layers)",
          gap_growth("No PE", "depth 2", "depth 6", "first vs last", 0.029)),
    Claim("decay_last", "004 §5, Fig. 4", "A decay mask flips the bias towards the end",
          "−0.073", gap("Decay", "depth 2", "first vs last", -0.073)),
    Claim("rope_residual", "004 §5, Fig. 5", "RoPE with residual connections: strong first-position bias",
          "+0.394", gap("RoPE", "depth 2 + res", "first vs last", 0.394)),
    Claim("lost_in_the_middle", "004 §1, Fig. 1", "Real LMs retrieve worse from the middle of the context",
          "U-shaped accuracy", lost_in_the_middle),
    Claim("longppl_scale", "000 §4.1, Table 1", "LongPPL predicts LongBench / RULER scores of 7B–72B models",
          "r = −0.96 over 9 models", not_testable("needs 7B+ models and LongBench; no GPU here")),
    Claim("cdt_scale", "002 §6, Table 1", "CDT on Llama-3-8B reaches GPT-4o on LongBench-E",
          "50.92 vs 51.00", not_testable("8B fine-tuning on 8×A100; no GPU here")),
    Claim("logo_scale", "003 §4, Table 2", "LOGO on Llama-3-8B-80K with 0.3B tokens beats long SFT",
          "+ 5 points", not_testable("8B fine-tuning; no GPU here")),
]  # fmt: skip


def evaluate(figures: Path, keys: list[str] | None = None) -> pd.DataFrame:
    """One row per claim (or per claim in ``keys``): the paper's number, ours with its interval, the
    setting and the verdict."""
    known = [claim.key for claim in CLAIMS]
    if unknown := set(keys or []) - set(known):
        raise ValueError(f"unknown claims {sorted(unknown)}; known: {known}")
    rows = []
    for claim in CLAIMS if keys is None else [c for c in CLAIMS if c.key in keys]:
        try:
            measured = claim.measure(figures)
        except (FileNotFoundError, LookupError, ValueError) as error:  # a study not run, or not this case
            measured = Measured(None, f"not run: {error}", ran=False)
        estimate = measured.estimate
        rows.append(
            dict(
                claim=claim.key,
                seed=claim.seed,
                statement=claim.statement,
                paper=claim.paper,
                ours=np.nan if estimate is None else estimate.value,
                low=np.nan if estimate is None else estimate.low,
                high=np.nan if estimate is None else estimate.high,
                n=np.nan if estimate is None else estimate.n,
                over="" if estimate is None else estimate.over,
                setting=measured.setting + (f" ({measured.note})" if measured.note else ""),
                verdict=verdict(measured),
            )
        )
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame) -> str:
    def ours(row) -> str:
        if np.isnan(row.ours):
            return "–"
        if np.isnan(row.low):
            return f"{row.ours:.3g} (n = {row.n:.0f})"
        return f"{row.ours:.3g} [{row.low:.3g}, {row.high:.3g}] (n = {row.n:.0f} {row.over})"

    lines = ["| claim | seed | paper | ours, 95 % CI | setting | verdict |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {row.statement} | {row.seed} | {row.paper} | {ours(row)} | {row.setting} | **{row.verdict}** |"
        for row in table.itertuples()
    ]
    return "\n".join(lines)


def update_results(results: Path, table: str, markers: tuple[str, str] = (START, END)) -> None:
    """Put ``table`` between the ``markers`` of ``results`` (atomically); the markers must be there."""
    start, end = markers
    text = results.read_text()
    if start not in text or end not in text:
        raise ValueError(f"{results} has no {start} … {end} markers to put the table between")
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1]
    atomic_write(results, lambda tmp: tmp.write_text(f"{before}{start}\n{table}\n{end}{after}"))


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--figures", type=Path, default=Path("figures"), help="where the studies' CSVs are")
    parser.add_argument("--results", default="RESULTS.md", help="file with the claims table ('' to skip)")
    args = parser.parse_args(argv)
    table = evaluate(args.figures)
    atomic_write(args.figures / "claims.csv", lambda tmp: table.to_csv(tmp, index=False))
    if args.results:
        update_results(Path(args.results), markdown(table))
    try:
        ranking = ranking_by_length(args.figures)
    except FileNotFoundError:  # no detector comparison yet: no ranking table
        ranking = None
    if ranking is not None:
        atomic_write(args.figures / "detector_by_length.csv", lambda tmp: ranking.to_csv(tmp, index=False))
        if args.results:
            update_results(Path(args.results), ranking_markdown(ranking), LENGTHS)
    print(markdown(table))
    return table


if __name__ == "__main__":
    main()
