"""Every peer and longprobe's detectors on the same samples, judged by the same exact ablation.

    python -m analyses.peers.compare --model smollm2-135m [--samples 6] [--peers lxt gim inseq:saliency ...]
        [--ours key_removal_banzhaf attn_lrp ...] [--out bench/results/peers/smollm2-135m-1024]

One invocation, one machine, one thread a process (``--threads``): the held-out study's samples
(:mod:`export_samples`) are exported once; each peer's runner scores them in its own environment
(``.venv-peers/NAME``, made by ``analyses/peers/setup.sh NAME``; ``NAME:METHOD`` for a peer with several
methods; run as ``python -m analyses.peers.NAME.run`` from the repository root); our detectors score them
here; then :func:`exchange.judge` judges every method on every sample (LDS on the same masks,
comprehensiveness, sufficiency, the additive ceiling), and one forward pass of each sample is timed to
turn seconds into forward-pass equivalents. Every cost is CPU seconds (``time.process_time`` of the
process that scores, one thread a process), not wall-clock time, so methods scored hours apart, beside
another job or across a pause still compare; seconds scored on another kind of CPU than the judging
machine's are no cost (NaN, :func:`exchange.read_scores`). Resumable: a peer's scores, our scores and
each judged sample are files in ``--out``, kept when the run is started again with the same settings
(``settings.json``; other settings are refused); a method scored after its sample was judged is judged
alone and added to the sample's part (:func:`exchange.judge_part`), and the tables hold the methods the
run names. ``--ablations``: the held-out study's saved passes of these samples
(``figures/studies/detector_MODEL-1024_*/``): the LDS masks, the additive ceiling's and every top-k mask
it ran are read, not run again. ``--score-only`` stops after the scoring, so the scoring can be shared
out over cores (one process a core, each its own ``--peers`` / ``--ours``, none of them a method another
is scoring); a last run without it judges, and so can a second beside it with ``--judge-backwards`` once
every method has scored.

Writes to ``--out``: ``samples.jsonl``, ``scores/*.jsonl``, ``judged/*.csv``, ``peers.csv`` (one row
per sample and method), ``summary.csv`` (per method: mean LDS and AOPC of comprehensiveness with 95 %
bootstrap intervals, the paired differences of both from :data:`BEST`'s, seconds and forward passes a
sample, samples with an LDS: a constant score has none), ``failures.csv`` and ``lds_vs_cost.png``
(LDS and the paired AOPC of comprehensiveness against forward passes; its data: ``summary.csv``).
Each peer we re-implement (:data:`COUNTERPARTS`) also gets, per sample, the Spearman correlation of
its source scores with our re-implementation's (``spearman_vs_ours``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import time
from pathlib import Path

import matplotlib
from scipy.stats import spearmanr

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
import torch  # noqa: E402
from adjustText import adjust_text  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

import probe  # noqa: E402
from probe import faithfulness, stats, tasks  # noqa: E402
from probe.atomic import atomic_write  # noqa: E402
from probe.cost import forward_seconds  # noqa: E402
from probe.errors import InvalidValueError  # noqa: E402
from probe.models import converted_folder  # noqa: E402

from ..arguments import length_setting  # noqa: E402
from ..claims import update_results  # noqa: E402
from ..comparison import EXPLAINED  # noqa: E402
from ..study_files import length_of, saved_passes  # noqa: E402
from . import exchange, peer_io  # noqa: E402
from .export_samples import heldout_samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]  # the repository root: the peers' runners run from there
# at2 last: its estimator is trained first (analyses/peers/at2/train.py), and that takes hours here
PEERS = ["context_cite", "lxt", "gim:full", "gim:shipped", "flashtrace", "inseq:attention", "inseq:saliency",
         "inseq:input_x_gradient", "inseq:integrated_gradients", "at2"]  # fmt: skip
OURS = ["key_removal_banzhaf", "information_flow", "grad_times_input", "embedding_grad", "attention",
        "attn_lrp", "at2", "integrated_gradients", "context_cite", "leave_one_out"]  # fmt: skip
KS = (1, 2, 4, 8)  # the held-out study's
RESULTS_MARKERS = "<!-- peers:start -->", "<!-- peers:end -->"
BEST = "key_removal_banzhaf"  # our best one-pass detector, every method's LDS is also given against it
# A runner's own options. inseq's integrated gradients runs 50 forward and backward passes for each answer
# token: kv's 31-36-token answers would take ~4 h a sample on one CPU thread (~25 h a model), so those
# samples are left out here, each with its reason (raise or drop the limit where a GPU runs it).
RUNNER_ARGS = {"inseq:integrated_gradients": ["--max-answer-tokens", "8"]}
# our re-implementation of each peer
COUNTERPARTS = {"context_cite": "context_cite", "at2": "at2", "lxt": "attn_lrp",
                "inseq:attention": "attention",
                "inseq:saliency": "embedding_grad", "inseq:input_x_gradient": "grad_times_input",
                "inseq:integrated_gradients": "integrated_gradients"}  # fmt: skip
PACKAGES = {"context_cite": "context-cite", "at2": "at2", "lxt": "lxt", "gim": "gim-explain",
            "flashtrace": "flashtrace", "inseq": "inseq"}  # fmt: skip


def version(peer: str) -> str:
    """The peer package's version in its environment (its ``freeze.txt``), or ``?``."""
    freeze = ROOT / ".venv-peers" / peer / "freeze.txt"
    lines = freeze.read_text().splitlines() if freeze.exists() else []
    wanted = PACKAGES[peer].lower()
    return next((line.split("==")[1] for line in lines if line.lower().startswith(wanted + "==")), "?")


def label(spec: str) -> str:
    """A peer's row name: package, version and method (``lxt 2.1``, ``inseq 0.7.1 saliency``)."""
    peer, _, method = spec.partition(":")
    return " ".join(filter(None, [PACKAGES[peer], version(peer), method]))


def runner_command(spec: str, exported: Path, out: Path, threads: int) -> list[str]:
    """The command that runs peer ``spec``'s runner in its environment (``.venv-peers/NAME``), with the
    runner's own options (:data:`RUNNER_ARGS`): ``python -m analyses.peers.NAME.run``, to be run with the
    repository root (:data:`ROOT`) as the working directory; its files as absolute paths."""
    peer, _, method = spec.partition(":")
    python = ROOT / ".venv-peers" / peer / "bin" / "python"
    files = [str(Path(exported).resolve()), str(Path(out).resolve())]
    command = [str(python), "-m", f"analyses.peers.{peer}.run", *files, "--threads", str(threads)]
    return [*command, *(["--method", method] if method else []), *RUNNER_ARGS.get(spec, [])]


def run_peer(spec: str, exported: Path, out: Path, threads: int) -> None:
    """Run peer ``spec``'s runner in its environment, its answers to ``out`` (skipped if there)."""
    if out.exists():
        return
    command = runner_command(spec, exported, out, threads)
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(threads)})


def run_ours(model, tokenizer, samples, name: str, out: Path) -> None:
    """Our detector ``name`` on every sample, written in a peer's answer format (resumable, skipped if
    there)."""
    if out.exists():
        return

    def answer(sample) -> dict:
        start = time.process_time()  # CPU seconds, as the peers' (peer_io.run)
        scores = probe.detect(name, model, tokenizer, sample).source_scores(sample).tolist()
        return {"key": exchange.sample_key(sample), "scores": scores, "seconds": time.process_time() - start}

    peer_io.resumable(out, ((exchange.sample_key(one), functools.partial(answer, one)) for one in samples))


def agreement(methods: dict, peers: list[str], ours: list[str]) -> pd.DataFrame:
    """Per sample, the Spearman correlation of each peer's source scores with its counterpart's among
    ``ours`` (:data:`COUNTERPARTS`): one row per (sample, peer) both scored."""
    rows = []
    for spec in peers:
        counterpart = COUNTERPARTS.get(spec)
        if counterpart not in ours:
            continue
        theirs, mine = methods[label(spec)], methods[counterpart]
        for key in sorted(set(theirs) & set(mine)):
            rho = spearmanr(theirs[key][0].numpy(), mine[key][0].numpy()).statistic
            rows.append({"sample": key, "scorer": label(spec), "spearman_vs_ours": rho})
    return pd.DataFrame(rows, columns=["sample", "scorer", "spearman_vs_ours"])


def summary(table: pd.DataFrame, best: str = BEST) -> pd.DataFrame:
    """Per method: mean LDS and AOPC of comprehensiveness with intervals over samples, its cost, and the
    paired differences of both from ``best``'s on the samples both scored (``lds_minus_best``: what
    "within the interval of our best one-pass detector" is decided on; ``aopc_minus_best``: AOPC compared
    on the same samples, which their raw means are not where a method scored fewer). ``lds_share`` is NaN
    for a run judged without the additive ceiling (``--ceiling-masks 0``)."""
    by_sample = {
        column: table.pivot_table(index="sample", columns="scorer", values=column)
        for column in ("lds", "aopc_comprehensiveness")
    }

    def paired(method: str, column: str) -> stats.Estimate:
        values = by_sample[column]
        difference = (values[method] - values.get(best, math.nan)).dropna().to_numpy()
        return (
            stats.bootstrap(difference)
            if len(difference)
            else stats.Estimate(math.nan, math.nan, math.nan, 0)
        )

    rows = []
    for (method, source), group in table.groupby(["scorer", "source"], sort=False):
        lds = stats.bootstrap(group.lds.to_numpy())
        comp = stats.bootstrap(group.aopc_comprehensiveness.to_numpy())
        gap, comp_gap = paired(method, "lds"), paired(method, "aopc_comprehensiveness")
        rows.append({"method": method, "source": source, "samples": lds.n, "lds": lds.value,
                     "lds_low": lds.low, "lds_high": lds.high, "aopc_comprehensiveness": comp.value,
                     "aopc_low": comp.low, "aopc_high": comp.high, "lds_minus_best": gap.value,
                     "lds_minus_best_low": gap.low, "lds_minus_best_high": gap.high,
                     "aopc_minus_best": comp_gap.value, "aopc_minus_best_low": comp_gap.low,
                     "aopc_minus_best_high": comp_gap.high,
                     "lds_share": group.lds_share.mean() if "lds_share" in group else math.nan,
                     "seconds": group.seconds.mean(),
                     "forwards": group.forwards.mean(),
                     "spearman_vs_ours": group.spearman_vs_ours.mean()})  # fmt: skip
    return pd.DataFrame(rows).sort_values("lds", ascending=False)


def results_markdown(runs: Path) -> str:
    """RESULTS.md's table of every finished comparison (``runs/MODEL-LENGTH/summary.csv``): per model and
    method its samples, LDS and its share of the additive ceiling, the paired differences from
    :data:`BEST`'s of LDS and of AOPC of comprehensiveness, CPU seconds and forward passes a sample, and
    the Spearman correlation with our re-implementation."""

    head = (
        "| model, length | method | samples | LDS, 95 % CI | share of ceiling | LDS − `key_removal_banzhaf`,"
        " paired | AOPC comp. (nats) | CPU s a sample | forwards a sample | Spearman vs ours |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(runs.glob("*/summary.csv")):
        for row in pd.read_csv(path).itertuples():
            reference = row.source == "reference"
            lines.append(
                f"| {path.parent.name} | {'*' if reference else ''}{row.method}{'*' if reference else ''} "
                f"| {row.samples} | {stats.row_interval(row, 'lds')} | {stats.number_text(row.lds_share)} "
                f"| {stats.row_interval(row, 'lds_minus_best')} "
                f"| {stats.row_interval(row, 'aopc_minus_best')} "
                f"| {stats.number_text(row.seconds, 1)} | {stats.number_text(row.forwards, 1)} "
                f"| {stats.number_text(row.spearman_vs_ours)} |"
            )
    return "\n".join(lines) if len(lines) > 2 else "(no comparison has finished yet)"


def plot(found: pd.DataFrame, title: str) -> plt.Figure:
    """LDS, and AOPC of comprehensiveness paired with :data:`BEST`'s, against forward-pass equivalents a
    sample: one point per method, 95 % intervals, labels moved apart (``adjustText``); the additive
    ceiling dashed."""
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5), sharex=True)
    shown = found[found.forwards.notna()]
    panels = [
        ("lds", "lds_low", "lds_high", "LDS (mean, 95 % CI)"),
        ("aopc_minus_best", "aopc_minus_best_low", "aopc_minus_best_high",
         f"AOPC of comprehensiveness − {BEST}'s, paired (nats, 95 % CI)"),
    ]  # fmt: skip
    for ax, (column, low, high, label) in zip(axes, panels, strict=True):
        sns.scatterplot(data=shown, x="forwards", y=column, hue="source", style="source", s=70, ax=ax)
        error = [shown[column] - shown[low], shown[high] - shown[column]]
        ax.errorbar(shown.forwards, shown[column], yerr=error, fmt="none", ecolor="grey", elinewidth=0.8)
        for ceiling in found.loc[found.method == "additive_ceiling", column]:
            ax.axhline(
                ceiling, color="darkred", linestyle="--", linewidth=0.8, label="additive ceiling (ref.)"
            )
        ax.set(xscale="log", xlabel="cost: forward-pass equivalents a sample (log)", ylabel=label)
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # readable under a decade too
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=8)
        labels = [
            ax.text(row.forwards, getattr(row, column), row.method, fontsize=7) for row in shown.itertuples()
        ]
        adjust_text(labels, ax=ax, arrowprops={"arrowstyle": "-", "color": "grey", "lw": 0.5})
    fig.suptitle(title)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tasks", nargs="+", default=list(tasks.HELD_OUT_TASKS))
    parser.add_argument("--samples", type=int, default=6, help="samples a task (the held-out study: 6)")
    parser.add_argument(
        "--seed", type=int, default=5000, help="first sample's seed; seed of the LDS masks (the study's)"
    )
    parser.add_argument("--length", type=length_setting, default=1024, help="tokens, or 'natural'")
    parser.add_argument(
        "--explain", choices=EXPLAINED, default=None,
        help="the answer explained: gold, or the model's own (default: own for real questions)",
    )  # fmt: skip
    parser.add_argument("--peers", nargs="*", default=PEERS)
    parser.add_argument("--ours", nargs="*", default=OURS, choices=probe.detectors.names())
    parser.add_argument("--masks", type=int, default=32)
    parser.add_argument("--ceiling-masks", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--results", default=str(ROOT / "RESULTS.md"),
        help="file whose peers table (between its peers markers) is rewritten from every run ('' to skip)",
    )  # fmt: skip
    parser.add_argument(
        "--ablations", type=Path, default=None,
        help="a held-out study's folder or its *_ablations.csv.gz: its masked passes are not run again",
    )  # fmt: skip
    parser.add_argument(
        "--score-only", action="store_true",
        help="score with --peers and --ours and stop before judging (to share the scoring out over cores)",
    )  # fmt: skip
    parser.add_argument(
        "--judge-backwards", action="store_true",
        help="judge the samples last to first: a second process judging beside a first (parts are written"
        " whole, so the one sample both reach is judged twice, never half)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    unknown = [spec for spec in args.peers if spec.partition(":")[0] not in PACKAGES]
    if unknown:
        parser.error(f"unknown peers {unknown}; peers: {', '.join(PACKAGES)}")
    packages = {spec.partition(":")[0] for spec in args.peers}
    unnamed = sorted(peer for peer in packages if version(peer) == "?")
    if unnamed and not args.score_only:
        parser.error(
            f"no environment for {unnamed} (versions name the rows): run analyses/peers/setup.sh NAME"
        )
    torch.set_num_threads(args.threads)
    run = f"{args.model}-{length_of(args)}" + (f"-{args.explain}" if args.explain else "")
    out = args.out or ROOT / "bench" / "results" / "peers" / run
    # none of them changes a number
    ignored = ("peers", "ours", "threads", "out", "ablations", "results", "score_only", "judge_backwards")
    settings = {k: v for k, v in vars(args).items() if k not in ignored and (k != "explain" or v)}
    settings |= {"clock": "process_time", "runner_args": RUNNER_ARGS}
    (out / "scores").mkdir(parents=True, exist_ok=True)
    (out / "judged").mkdir(exist_ok=True)
    recorded = out / "settings.json"
    if recorded.exists() and json.loads(recorded.read_text()) != settings:
        raise SystemExit(f"{out} holds a run with other settings ({recorded}): pass another --out")
    atomic_write(recorded, lambda tmp: tmp.write_text(json.dumps(settings, indent=1)))

    model, tokenizer = probe.load_model(args.model)
    samples = heldout_samples(
        model, tokenizer, args.tasks, args.samples, args.seed, args.length, args.explain
    )
    exported = out / "samples.jsonl"
    if not exported.exists():
        exchange.export(samples, converted_folder(args.model), exported)
    files = {}
    for spec in args.peers:
        files[label(spec)] = (out / "scores" / f"{spec.replace(':', '_')}.jsonl", "peer")
        peer = spec.partition(":")[0]
        if peer in unnamed:  # --score-only (judging refuses above): nothing written, a later run scores it
            print(f"{spec}: skipped, no environment (run analyses/peers/setup.sh {peer})")
        else:
            run_peer(spec, exported, files[label(spec)][0], args.threads)
    for name in args.ours:
        files[name] = (out / "scores" / f"longprobe_{name}.jsonl", "longprobe")
        run_ours(model, tokenizer, samples, name, files[name][0])
    if args.score_only:
        return
    methods = {name: exchange.read_scores(path, samples) for name, (path, _) in files.items()}
    failures = [
        {"method": name, "sample": key, "error": error}
        for name, (path, _) in files.items()
        for key, error in exchange.failures(path).items()
    ]
    saved = None
    if args.ablations:
        try:
            saved = saved_passes(args.ablations, args.model, length_of(args), dtype="")  # the model's own
        except InvalidValueError as error:
            parser.error(str(error))
        print(f"{len(saved)} saved passes of {saved['sample'].nunique()} samples from {args.ablations}")
    judged = dict.fromkeys(map(exchange.sample_key, samples))  # each sample's part, in the samples' order
    judgement = faithfulness.Judgement(
        ks=KS, n_masks=args.masks, seed=args.seed, ceiling_masks=args.ceiling_masks
    )
    for sample in reversed(samples) if args.judge_backwards else samples:
        key = exchange.sample_key(sample)
        known = [] if saved is None else [faithfulness.Ablations.from_frame(saved, sample)]
        unit = functools.partial(forward_seconds, model, sample, time.process_time, logits_to_keep=0)
        judged[key] = exchange.judge_part(
            out / "judged" / f"{key}.csv", model, sample, methods, unit, judgement, known
        )
    sources = {name: source for name, (_, source) in files.items()} | {"additive_ceiling": "reference"}
    table = pd.concat([part for part in judged.values() if part is not None], ignore_index=True)
    table = table[table.scorer.isin(sources)]  # the methods this run names, though a part holds more
    table = table.merge(agreement(methods, args.peers, args.ours), on=["sample", "scorer"], how="left")
    table["source"] = table.scorer.map(sources)
    found = summary(table)
    atomic_write(out / "peers.csv", lambda tmp: table.to_csv(tmp, index=False))
    atomic_write(out / "summary.csv", lambda tmp: found.to_csv(tmp, index=False))
    failed = pd.DataFrame(failures, columns=["method", "sample", "error"])
    atomic_write(out / "failures.csv", lambda tmp: failed.to_csv(tmp, index=False))
    title = f"{args.model}, {length_of(args)} tokens, {len(samples)} samples ({', '.join(args.tasks)})"
    fig = plot(found, title)
    atomic_write(out / "lds_vs_cost.png", lambda tmp: fig.savefig(tmp, dpi=150, bbox_inches="tight"))
    print(found.round(3).to_string(index=False))
    if args.results:
        update_results(Path(args.results), results_markdown(out.parent), RESULTS_MARKERS)
    if failures:
        print(f"\n{len(failures)} failures: {out / 'failures.csv'}")


if __name__ == "__main__":
    main()
