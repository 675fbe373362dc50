"""The faithful default's judged run, from its files (``figures/studies/faithful_default_protocol.md``):
the folders of the protocol's commands (:data:`RUNS`), finished or still running (their finished parts).

Per model and part (1K held-out tasks, HotpotQA with the model's own answers, 1K pooled, 4K) and scorer:
the paired differences from exhaustive leave-one-out of LDS and of both AOPCs, each with a 95 % bootstrap
interval, signed so that above 0 is better (comprehensiveness: the scorer's minus leave-one-out's;
sufficiency: leave-one-out's minus the scorer's, as less kept-top loss is better); the share of samples
whose top source is leave-one-out's (their top-1 removals lose the same log-probability, so the same
source was removed); the mean cost in forward-pass equivalents (the detector's seconds over the sample's
plain forward pass, timed in the same process; a sample whose detector read passes an earlier, killed
process ran has no cost of its own and is left out of the mean); and, for the protocol's judged detector,
whether it wins: LDS's lower end ≥ −0.03, neither AOPC interval wholly below 0, the top source on ≥ 95 %
of samples, mean cost ≤ 6 forward passes at 1K and ≤ 10 at 4K. Beside them, where its peers' run has
finished (``bench/results/peers/judged-MODEL-1024/summary.csv``: the same samples scored again by the
public ``context-cite`` 0.0.4 and by ours, every cost in CPU seconds), each method's LDS and forward
passes there.
Writes ``figures/studies/faithful_default_judged.csv``, ``…_peers.csv`` and the tables between RESULTS.md's
``judged`` markers.

    python -m analyses.faithful_default_report
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from probe import stats
from probe.atomic import atomic_write

from .claims import update_results
from .detector_compare import command_folder
from .study_files import folder_rows

JUDGED = "leave_few_out"
DETECTORS = (
    "leave_few_out key_removal_banzhaf key_removal_grad information_flow attn_lrp context_cite leave_one_out"
)
COMMON = f"--loo-top-m all --ks 1 2 4 8 --masks 32 --time-forward --detectors {DETECTORS}"
HELD_OUT = f"--tasks multihop-4 kv document-2 key-token --seed 8000 {COMMON}"
#: (part, models, command): the protocol's commands
RUNS = (
    ("1K held-out tasks", ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"),
     f"--length 1024 --samples 6 {HELD_OUT}"),
    ("1K HotpotQA (own answers)", ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"),
     f"--length natural --tasks hotpotqa --samples 6 --seed 7100 {COMMON}"),
    ("4K held-out tasks", ("smollm2-135m", "qwen2.5-coder-0.5b"), f"--length 4096 --samples 3 {HELD_OUT}"),
)  # fmt: skip
BUDGET = {"1K": 6.0, "4K": 10.0}
PEERS = Path("bench/results/peers")  # the judged samples' peers runs: judged-MODEL-1024/
PEER_METHODS = ("context-cite 0.0.4", JUDGED, "key_removal_banzhaf", "leave_one_out")
MARKERS = "<!-- judged:start -->", "<!-- judged:end -->"


def judged_rows(figures: Path) -> pd.DataFrame:
    """Every finished sample's faithfulness rows of the run, with ``model``, ``part`` and each detector's
    cost in forward-pass equivalents (``cost``)."""
    found = []
    for part, models, command in RUNS:
        for model in models:
            metrics, faithful, _ = folder_rows(command_folder(model, command, figures))
            if faithful.empty:
                continue
            cost = metrics.assign(cost=metrics.seconds / metrics.forward_seconds)[
                ["task", "seed", "detector", "cost"]
            ].rename(columns={"detector": "scorer"})
            found.append(
                faithful.merge(cost, on=["task", "seed", "scorer"], how="left").assign(model=model, part=part)
            )
    return pd.concat(found, ignore_index=True) if found else pd.DataFrame()


def judged(rows: pd.DataFrame, part: str) -> list[dict]:
    """One row per model and scorer of ``rows`` (one part of the run, or several pooled as ``part``)."""
    records = []
    for model, of_model in rows.groupby("model", sort=False):
        keyed = of_model.set_index(["task", "seed", "scorer"])
        reference = keyed.xs("leave_one_out", level="scorer")
        for scorer in of_model.scorer.unique():
            mine = keyed.xs(scorer, level="scorer")
            paired = {
                "lds": mine.lds - reference.lds,
                "aopc_comprehensiveness": mine.aopc_comprehensiveness - reference.aopc_comprehensiveness,
                "aopc_sufficiency": reference.aopc_sufficiency - mine.aopc_sufficiency,
            }
            record = {"model": model, "part": part, "scorer": scorer}
            for name, values in paired.items():
                estimate = stats.bootstrap(values.dropna().to_numpy())
                record |= {name: estimate.value, f"{name}_low": estimate.low, f"{name}_high": estimate.high}
            same_top = np.isclose(
                mine.comprehensiveness_k1, reference.comprehensiveness_k1, rtol=0, atol=1e-6
            )
            record |= {"top_source_found": same_top.mean(), "cost": mine.cost.mean(), "samples": len(mine)}
            records.append(record)
    return records


def summary(rows: pd.DataFrame) -> pd.DataFrame:
    """:func:`judged` for each part of the run and for the 1K parts pooled, with the win verdict."""
    records = []
    for part, of_part in rows.groupby("part", sort=False):
        records += judged(of_part, part)
    records += judged(rows[rows.part.str.startswith("1K")], "1K pooled")
    table = pd.DataFrame(records)
    budget = table.part.str[:2].map(BUDGET)
    table["wins"] = (
        (table.lds_low >= -0.03)
        & (table.aopc_comprehensiveness_high >= 0)
        & (table.aopc_sufficiency_high >= 0)
        & (table.top_source_found >= 0.95)
        & (table.cost <= budget)
    )
    return table


def markdown(table: pd.DataFrame) -> str:
    """The judged detector's row and the reference detectors' LDS, per model and part."""
    if table.empty:
        return "Running: no judged sample finished yet."
    lines = [
        f"| model | part (samples) | `{JUDGED}`: LDS − leave-one-out [95 % CI] "
        "| AOPC comp. / suff. (+ = better) | top source found | forward passes | wins "
        "| `key_removal_banzhaf` LDS − l-o-o | `context_cite` |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def interval(row, name: str) -> str:
        return stats.row_interval(row, name, signed=True)

    for (model, part), of_part in table.groupby(["model", "part"], sort=False):
        by = of_part.set_index("scorer")
        if JUDGED not in by.index:
            continue
        row = by.loc[JUDGED]
        others = [interval(by.loc[name], "lds") if name in by.index else "–" for name in
                  ("key_removal_banzhaf", "context_cite")]  # fmt: skip
        lines.append(
            f"| {model} | {part} ({row.samples}) | {interval(row, 'lds')} | "
            f"{interval(row, 'aopc_comprehensiveness')} / {interval(row, 'aopc_sufficiency')} | "
            f"{row.top_source_found:.0%} | {stats.number_text(row.cost, 1)} | "
            f"{'yes' if row.wins else 'no'} | "
            f"{' | '.join(others)} |"
        )
    return "\n".join(lines)


def peer_rows(peers: Path) -> pd.DataFrame:
    """Per model whose peers run on the judged 1K samples has finished: :data:`PEER_METHODS`' LDS and
    forward passes (CPU seconds over one plain forward pass's)."""
    found = []
    for model in RUNS[0][1]:
        summary_file = peers / f"judged-{model}-1024" / "summary.csv"
        if summary_file.exists():
            table = pd.read_csv(summary_file)
            found.append(table[table.method.isin(PEER_METHODS)].assign(model=model))
    columns = ["model", "method", "samples", "lds", "lds_low", "lds_high", "forwards"]
    return pd.concat(found, ignore_index=True)[columns] if found else pd.DataFrame(columns=columns)


def peers_markdown(peers: pd.DataFrame) -> str:
    """The peers runs' table: per model, each method's LDS [95 % CI] and forward passes."""
    if peers.empty:
        return ""
    lines = ["| model (samples) | " + " | ".join(f"`{m}`: LDS, forward passes" for m in PEER_METHODS) + " |",
             "|---" * (len(PEER_METHODS) + 1) + "|"]  # fmt: skip
    for model, of_model in peers.groupby("model", sort=False):
        by = of_model.set_index("method")
        cells = [f"{stats.row_interval(by.loc[m], 'lds')}, {by.forwards[m]:.1f}"
                 if m in by.index else "–" for m in PEER_METHODS]  # fmt: skip
        lines.append(f"| {model} ({of_model.samples.max()}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--figures", type=Path, default=Path("figures"))
    parser.add_argument("--results", default="RESULTS.md", help="file with the judged markers ('' to skip)")
    parser.add_argument("--peers", type=Path, default=PEERS)
    args = parser.parse_args(argv)
    rows = judged_rows(args.figures)
    table = summary(rows) if not rows.empty else pd.DataFrame()
    peers = peer_rows(args.peers)
    studies = args.figures / "studies"
    atomic_write(studies / "faithful_default_judged.csv", lambda tmp: table.to_csv(tmp, index=False))
    atomic_write(studies / "faithful_default_judged_peers.csv", lambda tmp: peers.to_csv(tmp, index=False))
    text = "\n\n".join(part for part in (markdown(table), peers_markdown(peers)) if part)
    if args.results:
        update_results(Path(args.results), text, MARKERS)
    print(text)
    return table


if __name__ == "__main__":
    main()
