"""Which context tokens does the model really use, and which detector finds them? (the main job)

For each sample the model first answers greedily (scored against the gold answer); then, with
the gold answer teacher-forced, every chosen detector from the registry scores every token
(:func:`probe.detectors.detect_many`: the attention family from one shared forward+backward pass).
Each detector is judged two ways on the same samples:

- plausibility, :func:`probe.metrics.plausibility`: its token scores against the sample's exact spans;
- faithfulness, :func:`probe.faithfulness.evaluate`: its scores per source (fact, emoji, essay
  sentence; ``--source-reduce`` over a source's tokens, or the ablation detectors' own source
  scores) ranked, the top-k sources removed / kept (compacted passes, equal to key masking), and the
  gold answer's log-probability watched (comprehensiveness, sufficiency, AOPC over ``--ks``; LDS over
  ``--masks`` random masks), beside two references: ``ground_truth`` (the supporting facts) and
  ``random_sources`` (seeded uniform source scores).

Writes, with the CSV behind each figure (``{tag}`` = model and length):

- ``detector_{tag}_categories``: share of each detector's top-k tokens per category (CDT Fig. 7);
- ``detector_{tag}_layers``: per layer, how much more attention / information flow from the
  answer rows each category's tokens get than the average context token, correct vs wrong
  answers (CDT Fig. 3);
- ``detector_{tag}_scores``: AUROC, precision, recall and fact hit rate per detector;
- ``detector_{tag}_metrics.csv``: every plausibility metric per detector and sample;
- ``detector_{tag}_ablations.csv.gz``: every masked pass of the faithfulness judgement (one row per
  sample and mask: :meth:`probe.faithfulness.Ablations.to_frame`), so that other scores are judged
  on these samples without running them again (``python -m analyses.peers.compare --ablations``, or another
  run of this module with ``--known``: the masks it holds are read, the rest run);
- ``detector_{tag}_faithfulness``: deletion curves (log-prob drop of the gold answer vs the number
  of top sources removed) per detector, references dashed, correct vs wrong answers; the CSV has
  every faithfulness metric per sample and scorer;
- ``detector_{tag}_view_{detector}.html``: each detector's token view of the first sample
  (:mod:`probe.views`; self-contained, opens offline);
- ``detector_{tag}_ranks.{csv,md}``: each detector's plausibility rank (mean AUROC) beside its
  faithfulness ranks (mean AOPC of comprehensiveness, mean LDS), correct / wrong / all answers;
- ``detector_{tag}_intervals``: each scorer's mean AOPC (comprehensiveness, sufficiency) and LDS
  with 95 % bootstrap intervals over samples, and its paired difference from ``attention`` and from
  ``leave_one_out`` (the ablation reference, pruned by default), with intervals.
- ``detector_{tag}_verdicts.md`` (when ``leave_one_out`` ran): each scorer's LDS, its share of the
  additive ceiling and its paired differences from ``leave_one_out`` (LDS, AOPC of comprehensiveness
  and sufficiency) with the held-out protocol's words ("above" / "below" only where the interval
  excludes 0, else "matches").

The default, the main job, judges CDT's detectors (``attention``, ``information_flow``,
``embedding_grad``), the key-removal gradients (``key_removal_grad``, ``key_removal_banzhaf``) and
``leave_one_out`` on 24 samples (12 per task), with the protocol the studies at 4K and 8K use: k = 1, 4;
16 random masks for LDS; leave-one-out exact on the 8 sources ``key_removal_grad`` ranks highest and its
scaled estimate elsewhere (``--loo-top-m all``: exhaustive, one pass per source; ``--loo-rank-by
key_removal_grad attn_lrp``: exact on the top M of each, the held-out study's choice at 16K and 32K,
analyses/README.md). Every row says what the detector cost (``seconds``, ``passes``). Faithfulness costs
one masked pass per distinct mask (compacted: only the kept tokens run), at most 49 a sample with the
default's eight scorers; the masks leave-one-out ran are not run again. Other settings than the
defaults write to a folder of their own under ``figures/studies``, so that ``figures/`` holds exactly
what the default writes.
``--dtype bfloat16`` halves the time on a CPU with native bf16 matrix products (avx512_bf16, AMX) and
kept the main job's ranking (RESULTS.md, "The main job in bfloat16"); elsewhere it is slower.

    python -m analyses.detector_compare                               # the main job, SmolLM2, ~1K tokens
    python -m analyses.detector_compare --samples 4 --detectors attention information_flow
    python -m analyses.detector_compare --model gemma3-270m --length 4096 --tasks multihop-1 multihop-2
    python -m analyses.detector_compare --detectors attention fr embedding_grad information_flow \\
        grad_times_input at2 key_removal_grad key_removal_banzhaf attn_lrp lsd lexical_overlap recency \\
        leave_one_out --ks 1 2 4 8 --masks 32 --loo-top-m all          # the full 1K study of RESULTS.md
    python -m analyses.detector_compare --out STUDY_FOLDER ...its settings... --rejudge  # answers again
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pandas as pd

from probe import detectors, faithfulness, tasks
from probe.checks import model_context
from probe.cost import forward_seconds
from probe.errors import InvalidValueError
from probe.journal import Journal

from .arguments import add_device_arguments, check_device_arguments, check_out, length_setting, load
from .comparison import DEFAULT_DETECTORS, EXPLAINED, LOO_RANKER, compare_samples, explained
from .detector_figures import write_outputs
from .study_files import finished_study, length_of, options_of, rejudged, saved_passes
from .sweep import finish, job_parts, part_name, sweep

NOT_SETTINGS = ("resume", "rejudge", "out", "device", "known")  # arguments that do not make another study
NATURAL = 1024  # the length a natural-length study's length-based defaults (lsd's K) take
SAMPLES = 12  # per task: 24 samples, the fewest that give the intervals a meaning


def top_m(value: str) -> int | None:
    """``--loo-top-m``: a positive number of sources, or ``all`` (None: exhaustive leave-one-out)."""
    if value == "all":
        return None
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of sources or 'all', got {value!r}")
    return int(value)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (the module docstring), refused (``parser.error``) before any model loads where a
    setting is wrong (:func:`refusal`), a folder in ``--out`` cannot be written or ``--device`` is absent."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_sample_arguments(parser)
    add_judgement_arguments(parser)
    add_run_arguments(parser)
    add_device_arguments(parser)  # --device, --dtype
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if (refused := refusal(args)) is not None:
        parser.error(refused)
    if args.out is not None:
        check_out(parser, args.out)
    check_device_arguments(parser, args)
    return args


def add_sample_arguments(parser: argparse.ArgumentParser) -> None:
    """What is explained: the model, its samples and their answer."""
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="model name or local HF folder")
    add("--tasks", nargs="+", default=["multihop-1", "multihop-2"], choices=tasks.names())
    add("--task-options", nargs="*", type=task_option, default=[], metavar="KEY=NUMBER",
        help="options of the tasks that take them, e.g. alpha=1.5 (key-token's LSD threshold)",
    )  # fmt: skip
    add("--length", type=length_setting, default=1024,
        help="prompt length in tokens, or 'natural' (a real question's own length: tasks with one only)",
    )  # fmt: skip
    add("--explain", choices=EXPLAINED, default=None,
        help="the answer the detectors explain, teacher-forced: the gold one or the model's own greedy "
        "answer (its correctness in every row); default: own for real questions (hotpotqa), gold elsewhere",
    )  # fmt: skip
    add("--samples", type=int, default=SAMPLES, help=f"samples per task (default {SAMPLES})")


def add_judgement_arguments(parser: argparse.ArgumentParser) -> None:
    """The detectors and how they are judged."""
    add = parser.add_argument
    add("--detectors", nargs="+", default=None, choices=detectors.names(),
        help=f"default: {' '.join(DEFAULT_DETECTORS)}",
    )  # fmt: skip
    add("--ks", type=int, nargs="+", default=[1, 4],
        help="numbers of top sources removed / kept (comprehensiveness, sufficiency; default 1 4)",
    )  # fmt: skip
    add("--top-k", type=int, default=30, help="k of the top-k sets (CDT uses 30)")
    add("--lsd-k", type=int, default=None, help="short context K of lsd (default: length / 4)")
    add("--source-reduce", default="mean", choices=faithfulness.REDUCTIONS,
        help="token scores -> one score per source (default mean: a sum favours long sentences)",
    )  # fmt: skip
    add("--masks", type=int, default=16, help="random source masks per sample for LDS")
    add("--ceiling-masks", type=int, default=0,
        help="fit the additive_ceiling reference on this many further random masks a sample (0: none; "
        "the held-out study uses 256)",
    )  # fmt: skip
    add("--loo-top-m", type=top_m, default=8,
        help=f"leave_one_out exact on the M sources {LOO_RANKER} ranks highest, the rest its scaled "
        "estimate (default 8; 'all': exhaustive, one pass per source)",
    )  # fmt: skip
    add("--loo-rank-by", nargs="+", default=None, choices=detectors.names(), metavar="DETECTOR",
        help="the detectors whose top --loo-top-m sources a pruned leave_one_out removes one by one "
        f"(their union; the first scales onto the rest; default {LOO_RANKER})",
    )  # fmt: skip


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How the study runs: answers, seeds, batches, timing."""
    add = parser.add_argument
    add("--max-new-tokens", type=int, default=None,
        help="greedy answer's length for the correct / wrong split (default: the gold answer's tokens + 4, "
        "so that a long answer such as a kv UUID is never cut)",
    )  # fmt: skip
    add("--seed", type=int, default=0, help="first sample's seed; seed of the LDS masks")
    add("--batch-size", type=int, default=1,
        help="samples per detector pass and masked passes per forward (default 1 on this 2-core CPU: "
        "batches of 4 sped up leave-one-out's passes 1.2x but slowed the whole faithfulness evaluation, "
        "see bench/README.md; on a GPU use 8-16)",
    )  # fmt: skip
    add("--time-forward", action="store_const", const=True, default=None,
        help="time one plain forward pass of each sample (best of two) into its rows' forward_seconds: "
        "the unit of a detector's cost in forward-pass equivalents, seconds / forward_seconds",
    )  # fmt: skip


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the study is written and what it takes from earlier runs."""
    add = parser.add_argument
    add("--out", type=Path, default=None,
        help="default: figures/ for the default settings (what the README and RESULTS.md show), else "
        "figures/studies/detector_{model}-{length}_{settings hash}/",
    )  # fmt: skip
    add("--resume", action="store_true",
        help="keep the batches a killed run finished and the detections and masked passes of the one it "
        "was in (in OUT/.detector_*_parts); a study that finished in OUT with these settings runs no more",
    )  # fmt: skip
    add("--known", type=Path, default=None,
        help="a study folder (or its *_ablations.csv.gz) run with the same --model, --length and --dtype: "
        "every masked pass it saved of these samples is read, not run again (the same numbers, fewer "
        "passes; e.g. the pruned leave-one-out reference beside an exhaustive run)",
    )  # fmt: skip
    add("--rejudge", action="store_true",
        help="a finished study (in OUT, given with the settings it ran with): each sample's greedy answer "
        "again under --max-new-tokens (generated, correct / wrong) and every table and figure redrawn; "
        "no detector runs again",
    )  # fmt: skip


def refusal(args: argparse.Namespace) -> str | None:
    """The message of the first rule the parsed ``args`` break (for ``parser.error``), or None."""
    offered = {key for task in args.tasks for key in options_of(task, args.task_options)}
    unused = {key for key, _ in args.task_options} - offered
    rejudge, known = args.rejudge, args.known
    rules = [
        (args.batch_size < 1, "--batch-size must be at least 1"),
        (args.samples < 1, "--samples must be at least 1"),
        (args.masks < 2, "--masks must be at least 2 (LDS is a rank correlation over masks)"),
        (unused, f"--task-options {sorted(unused)}: no task of --tasks takes them"),
        (args.max_new_tokens is not None and args.max_new_tokens < 1, "--max-new-tokens must be at least 1"),
        (args.ceiling_masks < 0, "--ceiling-masks must be 0 (no ceiling) or a number of masks"),
        (args.length is None and set(args.tasks) - set(tasks.NATURAL_LENGTH),
         f"--length natural is for tasks with a natural length ({', '.join(tasks.NATURAL_LENGTH)})"),
        (args.length is not None and args.length < 64, "--length must be at least 64 tokens"),
        (min(args.ks) < 1, "--ks must be positive numbers of sources"),
        (args.lsd_k is not None and not 1 <= args.lsd_k < (args.length or NATURAL),
         f"--lsd-k must be between 1 and the length - 1, got {args.lsd_k}"),
        (args.top_k < 1, "--top-k must be at least 1"),
        (args.loo_rank_by and (args.loo_top_m is None or "leave_one_out" in args.loo_rank_by),
         "--loo-rank-by ranks for a pruned leave_one_out: give --loo-top-m a number (not 'all') and "
         "other detectors than leave_one_out"),
        (rejudge and args.explain == "own",
         "--rejudge answers again without changing what was explained: not with --explain own"),
        (rejudge and args.resume,
         "--rejudge redraws a finished study, --resume continues an unfinished one: give one"),
        (known is not None and rejudge, "--known lends passes to a run, --rejudge runs none: give one"),
        (known is not None and not known.exists(),
         f"--known {known} does not exist: give a study folder or its *_ablations.csv.gz"),
    ]  # fmt: skip
    return next((message for wrong, message in rules if wrong), None)


def task_option(text: str) -> tuple[str, float]:
    """``KEY=NUMBER`` from the command line (``alpha=-inf`` too)."""
    key, _, value = text.partition("=")
    try:
        return key, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"task options are KEY=NUMBER, got {text!r}") from None


def command_folder(model: str, command: str, figures: Path = Path("figures")) -> Path:
    """The folder this analysis writes for ``model`` and the options ``command`` (as typed after
    ``--model MODEL``), under ``figures``."""
    return figures / study_folder(parse_args(["--model", model, *command.split()])).relative_to("figures")


def study_folder(args: argparse.Namespace) -> Path:
    """``figures`` for the main job's default settings (any model and length: their files are named by
    both), else a folder of its own under ``figures/studies``, named by a hash of the settings."""
    defaults = vars(parse_args([]))
    chosen = {
        key: value for key, value in vars(args).items() if key not in (*NOT_SETTINGS, "model", "length")
    }
    for later in (
        "dtype",
        "loo_rank_by",
        "explain",
        "time_forward",
    ):  # at its default, the folder keeps the name it had before
        if chosen[later] is None:
            del chosen[later]
    if all(value == defaults[key] for key, value in chosen.items()):
        return Path("figures")
    digest = hashlib.sha1(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return Path("figures") / "studies" / f"detector_{tag_of(args)}_{digest}"


def tag_of(args: argparse.Namespace) -> str:
    """The model and length that name a study's files: ``smollm2-135m-1024``, ``…-natural``."""
    return f"{Path(args.model).name}-{length_of(args)}"


def detector_options(
    names: list[str],
    length: int,
    seed: int,
    loo_top_m: int | None = None,
    top_k: int = 30,
    lsd_k: int | None = None,
    loo_rank_by: list[str] | None = None,
) -> dict[str, dict]:
    """The study's options of each detector of ``names`` at ``length`` tokens: LSD's short context
    (``lsd_k``, default a quarter of the length), leave-one-out's ``top_m`` (None: exhaustive) and
    ``rank_by`` (``loo_rank_by``; None: its default), the top-k sets' ``top_k``, and masks for
    ``context_cite`` and ``key_removal_banzhaf`` drawn from ``seed + 1``, so that they differ from the
    LDS masks (``seed``)."""
    lsd_k = (length or NATURAL) // 4 if lsd_k is None else lsd_k
    options = {"lsd": {"K": lsd_k, "d": max(lsd_k // 2, 1)}}
    options["context_cite"] = options["key_removal_banzhaf"] = {"seed": seed + 1}
    options["leave_one_out"] = {"top_m": loo_top_m} | ({"rank_by": loo_rank_by} if loo_rank_by else {})
    return options | {name: {"top_k": top_k} for name in names if "top_k" in detectors.options(name)}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parse_args(argv)
    out = args.out or study_folder(args)
    names = args.detectors or DEFAULT_DETECTORS
    tag = tag_of(args)
    finished = finished_study(args, out, tag, names) if args.rejudge else None
    saved = None
    if args.known is not None:
        try:
            saved = saved_passes(args.known, args.model, length_of(args), args.dtype or "")
        except InvalidValueError as error:
            raise SystemExit(f"--known: {error}") from None
        if saved.empty:
            raise SystemExit(f"--known {args.known} holds no saved passes: give a study that kept them")
    model, tokenizer = load(args)
    context = model_context(model)
    if (args.length or 0) + (args.max_new_tokens or 0) > context:
        raise SystemExit(
            f"--length {args.length} (+ the answer) exceeds {args.model}'s context of {context} tokens"
        )
    if finished is not None:
        found = rejudged(finished, args, model, tokenizer)
    else:
        found = run_study(args, out, tag, names, model, tokenizer, saved)
    if found is None:  # not the main process of an accelerate launch: it writes the outputs
        return pd.DataFrame()
    table = write_outputs(found, args, out, tag, names)
    finish(out / f".detector_{tag}_parts")  # every output is written: a --resume now runs nothing
    return table


def run_study(
    args, out: Path, tag: str, names: list[str], model, tokenizer, saved: pd.DataFrame | None = None
) -> dict[str, pd.DataFrame] | None:
    """Every sample of the study, in resumable batches (:func:`analyses.sweep.sweep`): the tables
    ``metrics``, ``layers``, ``faithfulness`` and ``ablations`` (the passes run here, not ``saved``'s:
    another study's, read where they hold a mask); None in a helper process of an accelerate launch."""
    options = detector_options(
        names, args.length, args.seed, args.loo_top_m, args.top_k, args.lsd_k, args.loo_rank_by
    )
    judgement = faithfulness.Judgement(
        ks=args.ks, n_masks=args.masks, seed=args.seed, ceiling_masks=args.ceiling_masks
    )
    samples = [(task, args.seed + i) for task in args.tasks for i in range(args.samples)]
    jobs = [sum(samples[i : i + args.batch_size], ()) for i in range(0, len(samples), args.batch_size)]
    parts = out / f".detector_{tag}_parts"

    def run(job: tuple) -> dict[str, pd.DataFrame]:
        """One batch of samples (``job`` = task, seed, task, seed, ...): its three tables. Its detections
        and masked passes are journaled as they finish (:class:`probe.journal.Journal`): with
        ``--resume`` a killed batch goes on mid-sample."""
        pairs = zip(job[::2], job[1::2], strict=True)
        ablations = []
        for done in job_parts(parts):  # a finished part holds all its journal did
            Journal(parts / done).clear()
        journal = Journal(parts / part_name(job))
        if not args.resume:  # a journal left by an earlier run may hold other settings' work
            journal.clear()
        with journal:
            made = [
                tasks.make(
                    task, tokenizer, args.length, seed, model=model, **options_of(task, args.task_options)
                )
                for task, seed in pairs
            ]
            chunk, answers = zip(
                *(explained(model, tokenizer, one, args.explain, args.max_new_tokens) for one in made),
                strict=True,
            )
            rows, layers, faithful = compare_samples(
                model,
                tokenizer,
                list(chunk),
                names,
                args.top_k,
                answers,
                options,
                source_reduce=args.source_reduce,
                judgement=judgement,
                how=faithfulness.Passes(batch_size=args.batch_size),
                pages=out / f"detector_{tag}_view" if job == jobs[0] else None,
                ablations=ablations,
                saved=saved,
            )
        layers = pd.concat(layers, ignore_index=True) if layers else pd.DataFrame()
        rows = pd.DataFrame(rows)
        if args.time_forward:
            units = {(one.task, one.seed): forward_seconds(model, one) for one in chunk}
            rows["forward_seconds"] = [units[key] for key in zip(rows.task, rows.seed, strict=True)]
        tables = {"metrics": rows, "layers": layers, "faithfulness": faithful}
        return tables | ({"ablations": pd.concat(ablations, ignore_index=True)} if ablations else {})

    settings = {key: value for key, value in vars(args).items() if key not in NOT_SETTINGS}
    settings["detectors"] = names  # the default set may change between runs: record what ran
    return sweep(
        jobs,
        run,
        parts,
        args.resume,
        desc=f"detector_compare {args.model} (batches)",
        settings=settings,
    )


if __name__ == "__main__":
    main()
