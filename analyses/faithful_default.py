"""Development of a default detector that matches exact leave-one-out at a few passes, on development seeds.

For each sample: exhaustive leave-one-out (one compacted pass per source: every source's exact drop),
32 random half masks (the LDS masks), the one-pass detectors' source scores (the shared pass's
``key_removal_grad``, ``information_flow`` and ``attention``; ``key_removal_banzhaf`` and ``attn_lrp``,
one pass each; the weighted pass at presence ½; each source's direct effect, :func:`direct_effects`,
without a backward pass), and a plain forward pass, timed, to express every cost in forward-pass
equivalents.
Then every candidate *few-removal* scorer is computed from these without running anything again: for
a set of rankers and a budget m, the union of each ranker's top m sources is "measured" (its exact
drops, read off the exhaustive passes, as a pruned leave-one-out measures them) and every other source
scores the first ranker's score times the least-squares scale onto the measured drops (AttriBoT's
pruning with our scale, :func:`probe.detectors.ablation.pruned_estimate`). Each candidate's LDS (on the
same masks) minus leave-one-out's, whether its top source is leave-one-out's, and its cost (its rankers'
passes plus one removal per measured source) are written per sample; the summary gives the paired LDS
difference with a 95 % bootstrap interval per model and candidate. Each sample's measurements are kept
(``OUT/arrays/MODEL-TASK-SEED.pt``: drops, masks, log-probabilities, rankings, costs), so that further
candidates are tried on them without running the model again.

Only development seeds: no sample of the held-out study (seeds 5000–5005), the HotpotQA study (seeds
0–31) or the default's judged run (7100–7105, 8000–8005) may be used here (:data:`RESERVED_SEEDS`).

    python -m analyses.faithful_default --model smollm2-135m --seeds 7000 7001 7002 \
        --out figures/studies/faithful_default_dev
    python -m analyses.faithful_default --model smollm2-135m --rescore \
        --out figures/studies/faithful_default_dev    # candidates added later, from the saved arrays
    python -m analyses.faithful_default --model smollm2-135m --aopc \
        --out figures/studies/faithful_default_dev    # top-k removals of AOPC_SCORERS beside leave-one-out's
"""

from __future__ import annotations

import argparse
import copy
import itertools
import time
from pathlib import Path

import pandas as pd
import torch

from probe import detectors, faithfulness, load_model, stats, tasks
from probe.atomic import atomic_write
from probe.checks import cache_keyword, hf_model
from probe.cost import forward_seconds
from probe.detectors.ablation import pruned_estimate, pruned_sources, weighted_rankings
from probe.faithfulness.compaction import masked_pass
from probe.target import target_value

from .comparison import explained

TASKS = ("multihop-4", "kv", "document-2", "key-token", "hotpotqa")
SHARED = ("key_removal_grad", "information_flow", "attention")
OWN_PASS = ("key_removal_banzhaf", "attn_lrp")
#: read off one pass in which every source weighs ½ (:func:`probe.detectors.ablation.weighted_rankings`)
WEIGHTED = ("key_removal_grad@0.5", "information_flow@0.5")
RANKER_SETS = (
    ("key_removal_grad",),
    ("key_removal_grad", "information_flow"),
    ("key_removal_grad", "attention"),
    ("key_removal_banzhaf", "information_flow"),
    ("key_removal_banzhaf", "attn_lrp"),
    ("key_removal_grad", "attn_lrp"),
    WEIGHTED,
)
#: each source's direct effect (:func:`direct_effects`): no backward, a step where the answer reads the source
DIRECT = "direct_effect"
BUDGETS = (1, 2, 3, 4)
BEFORE_TOP = " + the source before its top"
#: adaptive stopping: measure each ranker's top 1; only if no measured drop reaches this many nats, its top 2
STOP_AT = (0.5, 1.0, 2.0, 4.0)
#: measuring on while the ranking's first source is an estimate (:func:`few_out_scores` ``until_top``)
UNTIL_TOP = " until its top is measured"
#: the candidates whose top-k removals are measured (``--aopc``): name -> (measure, before_top)
AOPC_SCORERS = {"leave_few_out measure 2": (2, False), f"leave_few_out measure 2{BEFORE_TOP}": (2, True)}
MASKS = 32
#: Seeds of the held-out study, the HotpotQA study and the judged run: never development's
RESERVED_SEEDS = set(range(32)) | set(range(5000, 5006)) | set(range(7100, 7106)) | set(range(8000, 8006))


def measure(model, tokenizer, task: str, seed: int, length: int | None) -> tuple[dict, dict]:
    """One sample's measurements: (facts about it, arrays: drops, masks, actual, rankings, costs)."""
    sample, answer = explained(model, tokenizer, tasks.make(task, tokenizer, length, seed, model=model), None)
    unit = forward_seconds(model, sample)
    start = time.perf_counter()
    found = detectors.detect_many(list(SHARED), model, tokenizer, sample)
    costs = dict.fromkeys(SHARED, (time.perf_counter() - start) / unit)
    for name in OWN_PASS:
        start = time.perf_counter()
        found[name] = detectors.detect(name, model, tokenizer, sample)
        costs[name] = (time.perf_counter() - start) / unit
    rankings = {name: detection.source_scores(sample) for name, detection in found.items()}
    weighted, costs_weighted = measure_weighted(model, sample, unit)
    direct, costs_direct = measure_direct(model, sample, unit)
    n = len(sample.sources)
    start = time.perf_counter()
    drops, _ = faithfulness.leave_one_out_drops(model, sample, range(n))
    removal = (time.perf_counter() - start) / unit / (n + 1)  # a removal pass, in forward passes
    kept = faithfulness.random_masks(n, MASKS, seed=seed)
    actual = faithfulness.answer_scores(model, sample, ~kept).logprob
    about = {"task": task, "seed": seed, "sources": n, "tokens": len(sample.input_ids), **answer}
    return about, {"drops": drops, "kept": kept, "actual": actual, "rankings": rankings | weighted | direct,
                   "costs": costs | costs_weighted | costs_direct, "removal": removal}  # fmt: skip


def measure_weighted(model, sample, unit: float) -> tuple[dict, dict]:
    """(the :data:`WEIGHTED` rankings, their cost in forward passes): one pass at presence ½."""
    start = time.perf_counter()
    rankings, slope = weighted_rankings(model, sample, [name.split("@")[0] for name in WEIGHTED], 0.5)
    cost = (time.perf_counter() - start) / unit
    return dict(zip(WEIGHTED, [slope, rankings[1]], strict=True)), dict.fromkeys(WEIGHTED, cost)


def direct_effects(model, sample: tasks.Sample) -> torch.Tensor:
    """Each source's direct effect on the answer, Tensor[sources]: the answer's log-probability lost when
    the rows after the last source (the question and the answer) no longer see the source's keys, every
    context token's state kept as in the full pass (an attention knockout at the rows that read the
    context; removal without its paths through later context tokens). One pass over the context, then
    its suffix once per source from a copy of the context's cache: no backward pass, and a step, not a
    slope, where the answer is read off one source."""
    inner = hf_model(model)
    ids, targets = sample.input_ids[None], sample.target_positions
    rows, gold = targets - 1, ids[0, targets]
    first = max(source.end for source in sample.sources)
    hidden = torch.zeros(len(sample.sources) + 1, ids.shape[1], dtype=torch.bool)  # the first: none hidden
    for index, source in enumerate(sample.sources, start=1):
        hidden[index, source.start : source.end] = True
    with torch.inference_mode():
        cache = inner(input_ids=ids[:, :first], use_cache=True, logits_to_keep=1)[cache_keyword(inner)]
        passes = (masked_pass(inner, ids, mask[None], first, copy.deepcopy(cache), rows) for mask in hidden)
        logprob = torch.stack([target_value(None, logits[0], gold) for logits in passes]).cpu()
    return logprob[0] - logprob[1:]


def measure_direct(model, sample, unit: float) -> tuple[dict, dict]:
    """(the :data:`DIRECT` ranking, its cost in forward passes)."""
    start = time.perf_counter()
    effects = direct_effects(model, sample)
    return {DIRECT: effects}, {DIRECT: (time.perf_counter() - start) / unit}


def completed(
    model, tokenizer, arrays: Path, model_name: str, task: str, seed: int, length: int | None
) -> None:
    """Add the :data:`WEIGHTED` and :data:`DIRECT` rankings to a sample's saved measurements that lack
    them (rankings added after it ran): its sample made again, its own answer generated again."""
    path = arrays / f"{model_name}-{task}-{seed}.pt"
    measured = torch.load(path)
    missing = [measure for names, measure in ((WEIGHTED, measure_weighted), ((DIRECT,), measure_direct))
               if not set(names) <= set(measured["rankings"])]  # fmt: skip
    if not missing:
        return
    sample, _ = explained(model, tokenizer, tasks.make(task, tokenizer, length, seed, model=model), None)
    if len(sample.sources) != len(measured["drops"]):
        raise RuntimeError(f"{path.name}: the sample made again has other sources than the one measured")
    unit = forward_seconds(model, sample)
    for measure_more in missing:
        rankings, costs = measure_more(model, sample, unit)
        measured["rankings"] |= rankings
        measured["costs"] |= costs
    atomic_write(path, lambda tmp: torch.save(measured, tmp))


def candidates(about: dict, measured: dict) -> list[dict]:
    """Every candidate's row on one sample (and leave-one-out's and the rankers' own)."""
    drops, kept, actual = measured["drops"], measured["kept"], measured["actual"]
    reference = faithfulness.lds(drops, kept, actual)
    top = int(torch.argmax(drops))

    def row(scorer: str, rankers: str, budget: int, scores: torch.Tensor, found: bool, cost: float) -> dict:
        lds = faithfulness.lds(scores, kept, actual)
        return {**about, "scorer": scorer, "rankers": rankers, "budget": budget, "lds": lds,
                "lds_minus_loo": lds - reference, "top_source_found": found, "cost": cost}  # fmt: skip

    rows = [row("leave_one_out", "", len(drops), drops, True, len(drops) * measured["removal"])]
    for name, ranking in measured["rankings"].items():
        rows.append(row(name, name, 0, ranking, int(torch.argmax(ranking)) == top, measured["costs"][name]))
    sets = [rankers for rankers in RANKER_SETS if set(rankers) <= set(measured["rankings"])]
    for rankers, budget in itertools.product(sets, BUDGETS):
        ranking = torch.stack([measured["rankings"][name] for name in rankers])
        chosen = pruned_sources(ranking, budget)
        scores = pruned_estimate(ranking[0], chosen, drops[chosen])
        passes = {pass_of(name): measured["costs"][name] for name in rankers}
        cost = sum(passes.values()) + (len(chosen) + 1) * measured["removal"]
        found = top in chosen.tolist() and int(torch.argmax(scores)) == top
        rows.append(row(f"{'+'.join(rankers)} top {budget}", "+".join(rankers), budget, scores, found, cost))
        for other in rankers[1:]:  # the same measured sources, the rest scored by another of the rankers
            rest = pruned_estimate(measured["rankings"][other], chosen, drops[chosen])
            found = top in chosen.tolist() and int(torch.argmax(rest)) == top
            name = f"{'+'.join(rankers)} top {budget} rest {other}"
            rows.append(row(name, "+".join(rankers), budget, rest, found, cost))
        if rankers == WEIGHTED:  # leave_few_out(measure=budget): the rest as the gradient gives it
            variants = [(False, None, False), (True, None, False), (False, None, True)]
            variants += [(False, stop, until) for stop in STOP_AT if budget == 2 for until in (False, True)]
            for before_top, stop_at, until_top in variants:
                scores, measured_here = few_out_scores(measured, budget, before_top, stop_at, until_top)
                found = top in measured_here.tolist() and int(torch.argmax(scores)) == top
                removals = len(measured_here) - len(chosen) + 1  # the sources added, the head check
                cost_here = cost + removals * measured["removal"]
                name = f"leave_few_out measure {budget}{BEFORE_TOP if before_top else ''}"
                if stop_at is not None:
                    name = f"leave_few_out measure 1, {budget} below {stop_at:g} nats"
                name += UNTIL_TOP if until_top else ""
                rows.append(row(name, "+".join(rankers), budget, scores, found, cost_here))
    if DIRECT in measured["rankings"]:  # its top measured exactly, the rest as the direct effects give them
        for budget in BUDGETS:
            scores, chosen = few_out_scores(measured, budget, rankers=(DIRECT,))
            found = top in chosen.tolist() and int(torch.argmax(scores)) == top
            # its context pass holds the full context and every removal's prefix; one more: the head check
            cost = measured["costs"][DIRECT] + (len(chosen) + 1) * measured["removal"]
            rows.append(row(f"{DIRECT} measure {budget}", DIRECT, budget, scores, found, cost))
    return rows


def few_out_scores(
    measured: dict,
    budget: int,
    before_top: bool = False,
    stop_at: float | None = None,
    until_top: bool = False,
    rankers: tuple[str, ...] = WEIGHTED,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``leave_few_out``'s source scores with ``measure`` = ``budget``, Tensor[sources]; the sources it
    measures, LongTensor) from a sample's saved measurements. ``before_top``: the source just before the
    measured source of the largest drop is measured too (the sentence the answer's source is read after).
    ``stop_at`` (adaptive stopping): each ranker's top 1 is measured first, its top ``budget`` only if no
    drop among them reaches ``stop_at`` nats (no one source carries the answer). ``until_top``: then, while
    the highest-scoring source is an estimated one, it is measured too (the ranking's first source is
    always an exact drop). ``rankers``: the saved rankings whose tops are measured, the first scoring the
    rest (:data:`DIRECT` alone: its own candidate)."""
    drops = measured["drops"]
    rankings = torch.stack([measured["rankings"][name] for name in rankers])
    chosen = pruned_sources(rankings, budget)
    if stop_at is not None:
        first = pruned_sources(rankings, 1)
        if float(drops[first].max()) >= stop_at:
            chosen = first
    if before_top:
        best = int(chosen[torch.argmax(drops[chosen])])
        chosen = torch.tensor(list(dict.fromkeys([*chosen.tolist(), *([best - 1] if best > 0 else [])])))
    scores = measured["rankings"][rankers[0]].clone()
    scores[chosen] = drops[chosen]
    while until_top and (first := int(torch.argmax(scores))) not in chosen.tolist():
        chosen = torch.cat([chosen, torch.tensor([first])])
        scores[first] = drops[first]
    return scores, chosen


def aopc_rows(model, tokenizer, about: dict, measured: dict, length: int | None) -> list[dict]:
    """Comprehensiveness and sufficiency (nats lost with the top k removed / kept alone, k in
    :data:`~probe.faithfulness.masks.KS`, and their means, the AOPCs) of leave-one-out and of
    :data:`AOPC_SCORERS` on one sample, its sample made again (its own answer generated again)."""
    sample, _ = explained(
        model, tokenizer, tasks.make(about["task"], tokenizer, length, about["seed"], model=model), None
    )
    if len(sample.sources) != len(measured["drops"]):
        raise RuntimeError(f"{about['task']} {about['seed']}: the sample made again has other sources")
    scorers = {"leave_one_out": measured["drops"]} | {
        name: few_out_scores(measured, budget, before_top)[0]
        for name, (budget, before_top) in AOPC_SCORERS.items()
    }
    # evaluate's top-k removals (its two LDS masks, the fewest it takes, are not read)
    judged = faithfulness.evaluate(model, sample, scorers, faithfulness.Judgement(n_masks=2))
    measures = judged[["scorer", "aopc_comprehensiveness", "aopc_sufficiency"]].to_dict("records")
    return [{**about, **row} for row in measures]


def pass_of(name: str) -> str:
    """The pass a ranking is read off: the shared pass, the weighted one, or its own."""
    return "shared" if name in SHARED else "weighted" if name in WEIGHTED else name


def summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per model and scorer: mean LDS − leave-one-out's with its 95 % bootstrap interval, the share of
    samples whose top source is leave-one-out's, the mean cost in forward passes, and the samples."""
    records = []
    for (model, scorer), part in rows.groupby(["model", "scorer"], sort=False):
        estimate = stats.bootstrap(part.lds_minus_loo.to_numpy())
        records.append(
            {"model": model, "scorer": scorer, "lds_minus_loo": estimate.value, "low": estimate.low,
             "high": estimate.high, "top_source_found": part.top_source_found.mean(),
             "cost": part.cost.mean(), "samples": estimate.n}
        )  # fmt: skip
    return pd.DataFrame(records).sort_values(["model", "low"], ascending=[True, False])


def rescored(done: pd.DataFrame, arrays: Path, model: str) -> pd.DataFrame:
    """Every sample of ``done`` (one row per sample and candidate) scored again by :func:`candidates` from
    its saved measurements (``arrays/MODEL-TASK-SEED.pt``): candidates added later get their rows."""
    facts = list(done.columns[: done.columns.get_loc("scorer")])
    rows = []
    for _, first in done.drop_duplicates(["task", "seed"]).iterrows():
        measured = torch.load(arrays / f"{model}-{first.task}-{first.seed}.pt")
        rows += candidates(first[facts].to_dict(), measured)
    return pd.DataFrame(rows).assign(model=model)


def measured_aopcs(args: argparse.Namespace, done: pd.DataFrame) -> pd.DataFrame:
    """``--aopc``: :func:`aopc_rows` for every sample of ``done`` not yet in ``MODEL-LENGTH_aopc.csv``,
    then each scorer's AOPCs minus leave-one-out's, paired (comprehensiveness: + = more lost, better;
    sufficiency: + = less lost, better), with 95 % bootstrap intervals."""
    table = args.out / f"{args.model}-{args.length}_aopc.csv"
    found = pd.read_csv(table) if table.exists() else pd.DataFrame(columns=["task", "seed"])
    model, tokenizer = load_model(args.model)
    for task, seed in done[["task", "seed"]].drop_duplicates().itertuples(index=False):
        if ((found.task == task) & (found.seed == seed)).any():
            continue
        measured = torch.load(args.out / "arrays" / f"{args.model}-{task}-{seed}.pt")
        length = None if task in tasks.NATURAL_LENGTH else args.length
        rows = aopc_rows(model, tokenizer, {"task": task, "seed": int(seed)}, measured, length)
        found = pd.concat([found, pd.DataFrame(rows).assign(model=args.model)], ignore_index=True)
        atomic_write(table, lambda tmp, frame=found: frame.to_csv(tmp, index=False))
        print(f"{task} {seed}: top-k removals measured", flush=True)
    reference = found.query("scorer == 'leave_one_out'").set_index(["task", "seed"])
    records = []
    for scorer, part in found.query("scorer != 'leave_one_out'").groupby("scorer", sort=False):
        paired = part.set_index(["task", "seed"])
        differences = {
            "aopc_comprehensiveness": paired.aopc_comprehensiveness - reference.aopc_comprehensiveness,
            "aopc_sufficiency": reference.aopc_sufficiency - paired.aopc_sufficiency,
        }
        record = {"model": args.model, "scorer": scorer, "samples": len(paired)}
        for measure, difference in differences.items():
            estimate = stats.bootstrap(difference.dropna().to_numpy())
            record |= {
                measure: estimate.value,
                f"{measure}_low": estimate.low,
                f"{measure}_high": estimate.high,
            }
        records.append(record)
    result = pd.DataFrame(records)
    atomic_write(table.with_name(f"{table.stem}_summary.csv"), lambda tmp: result.to_csv(tmp, index=False))
    print(result.round(3).to_string(index=False))
    return result


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=tasks.names())
    parser.add_argument("--seeds", type=int, nargs="+", default=[], help="development seeds only")
    parser.add_argument(
        "--length", type=int, default=1024, help="prompt tokens (hotpotqa: its natural length)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--rescore", action="store_true",
        help="score every candidate again from the saved arrays of the samples done (no model runs)",
    )  # fmt: skip
    parser.add_argument(
        "--complete", action="store_true",
        help="add the rankings added since (the weighted pass, the direct effects) to the saved arrays, "
        "then --rescore",
    )  # fmt: skip
    parser.add_argument(
        "--aopc", action="store_true",
        help="measure the top-k removals of leave-one-out and of AOPC_SCORERS on the samples done "
        "(MODEL-LENGTH_aopc.csv, samples already there kept) and print their paired AOPCs",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.rescore = args.rescore or args.complete
    if not args.seeds and not (args.rescore or args.aopc):
        parser.error("--seeds: give the development seeds to run (or --rescore)")
    if set(args.seeds) & RESERVED_SEEDS:
        parser.error(
            "--seeds: the held-out study's (5000–5005), the HotpotQA study's (0–31) and the judged run's "
            "(7100–7105, 8000–8005; figures/studies/faithful_default_protocol.md) are not for development"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    table = args.out / f"{args.model}-{args.length}.csv"
    done = pd.read_csv(table) if table.exists() else pd.DataFrame(columns=["task", "seed"])
    if args.complete:
        model, tokenizer = load_model(args.model)
        for task, seed in done[["task", "seed"]].drop_duplicates().itertuples(index=False):
            length = None if task in tasks.NATURAL_LENGTH else args.length
            completed(model, tokenizer, args.out / "arrays", args.model, task, int(seed), length)
            print(f"{task} {seed}: completed", flush=True)
    if args.rescore:
        done = rescored(done, args.out / "arrays", args.model)
        atomic_write(table, lambda tmp, frame=done: frame.to_csv(tmp, index=False))
    if args.aopc:
        return measured_aopcs(args, done)
    model, tokenizer = (None, None) if args.rescore else load_model(args.model)
    for task, seed in itertools.product(args.tasks, [] if args.rescore else args.seeds):
        if ((done.task == task) & (done.seed == seed)).any():
            continue
        length = None if task in tasks.NATURAL_LENGTH else args.length
        about, measured = measure(model, tokenizer, task, seed, length)
        arrays = args.out / "arrays" / f"{args.model}-{task}-{seed}.pt"  # for candidates tried later
        atomic_write(arrays, lambda tmp, found=measured: torch.save(found, tmp))
        rows = pd.DataFrame(candidates(about, measured)).assign(model=args.model)
        done = pd.concat([done, rows], ignore_index=True)
        atomic_write(table, lambda tmp, frame=done: frame.to_csv(tmp, index=False))
        print(f"{task} {seed}: done", flush=True)
    result = summary(done.assign(model=args.model))
    atomic_write(table.with_name(f"{table.stem}_summary.csv"), lambda tmp: result.to_csv(tmp, index=False))
    print(result.round(3).to_string(index=False))
    return result


if __name__ == "__main__":
    main()
