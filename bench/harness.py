"""What every benchmark here shares: one child process per measurement, peak RSS, ratios, the CSV.

A benchmark (``python -m bench.NAME`` from the repository root) calls :func:`run_children` from its parent
process, which runs each measurement as ``python -m bench.NAME --child ...``; each child loads what
it needs (:func:`load`: on ``--device`` in ``--dtype``), then calls :func:`measure`, which warms up,
resets the kernel's peak-RSS counter (``/proc/self/clear_refs``; CUDA's peak counter on a GPU), runs
the method once and reports wall time and the peak memory above the warmed-up state. Separate
processes keep every peak clean; all rows of one table come from one invocation, so their ratios
compare like with like.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pandas as pd

from probe.atomic import atomic_write
from probe.journal import Journal


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory (``VmRSS``) or its peak since the last reset (``VmHWM``), MiB."""
    status = Path("/proc/self/status").read_text()
    return int(status.split(f"{field}:")[1].split()[0]) / 1024


def measure(
    run: Callable[[], object], warm_up: Callable[[], object], device: str = "cpu"
) -> tuple[dict, object]:
    """Run ``warm_up`` (page in weights, warm kernels), then time ``run`` once and take its peak
    memory above the warmed-up state: peak RSS on the CPU, ``torch.cuda.max_memory_allocated`` (and
    synchronized time) on a GPU."""
    import torch

    cuda = torch.device(device).type == "cuda"
    warm_up()
    if cuda:
        torch.cuda.synchronize()
        loaded = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        loaded = rss_mib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (peak RSS) to the current RSS
    start = time.perf_counter()
    result = run()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mib("VmHWM")
    return {"seconds": seconds, "peak_mib": peak - loaded, "loaded_mib": loaded}, result


# the published configs' shapes (config.json of meta-llama/Meta-Llama-3-8B, Qwen/Qwen2.5-7B and
# Qwen/Qwen2.5-0.5B, the shape of the bundled Qwen2.5-Coder-0.5B): timing and memory at a size the real
# weights cannot travel to (a GPU machine without the model hub); nothing is downloaded
RANDOM_CONFIGS = {
    "llama-3-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
        max_position_embeddings=131072, rms_norm_eps=1e-5,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
        max_position_embeddings=131072, rms_norm_eps=1e-6,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
}  # fmt: skip


def load(name: str, device: str = "cpu", dtype: str | None = None, tokenizer: str | None = None):
    """(model, tokenizer): ``probe.load_model(name)`` on ``device`` in ``dtype`` (default: its own), or,
    for a name of :data:`RANDOM_CONFIGS`, a random-weight model of that shape (bf16 unless ``dtype``;
    speed and memory do not depend on the weights; seeded, the same in every process) with the
    tokenizer of the folder ``tokenizer`` (any whose ids fit the vocabulary; ``None`` without one)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import probe

    if name not in RANDOM_CONFIGS:
        return probe.load_model(name, dtype=getattr(torch, dtype) if dtype else None, device=device)
    shape = dict(RANDOM_CONFIGS[name])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    torch.manual_seed(0)  # the same weights in every child process: their checksums compare
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, dtype or "bfloat16"), attn_implementation="sdpa"
        )
    return model.eval(), AutoTokenizer.from_pretrained(tokenizer) if tokenizer else None


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` (default cpu), ``--dtype`` (default: the model's own) and ``--tokenizer``."""
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    parser.add_argument(
        "--tokenizer", default=None, help="a random-shape model's tokenizer folder (harness.RANDOM_CONFIGS)"
    )


def device_arguments(args: argparse.Namespace) -> list[str]:
    """``--device`` / ``--dtype`` / ``--tokenizer`` as a child process is given them."""
    given = {"--dtype": args.dtype, "--tokenizer": args.tokenizer}
    return ["--device", args.device, *[text for pair in given.items() if pair[1] for text in pair]]


def run_children(module: str, args: list[str], jobs: Iterable[tuple[str, int]]) -> pd.DataFrame:
    """For each (method, length) run ``python -m module *args --child method length`` (from this working
    directory, the repository root, as the parent runs) and collect its JSON line."""
    rows = []
    for method, length in jobs:
        done = subprocess.run(
            [sys.executable, "-m", module, *args, "--child", method, str(length)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise RuntimeError(f"{method} at {length} tokens failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append({"length": length, "method": method, **result})
        print(
            f"{length:>6} {method:<17} {result['seconds']:8.1f} s {result['peak_mib']:9.0f} MiB", flush=True
        )
    return pd.DataFrame(rows)


def add_ratios(table: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Time and peak memory of every row as a ratio of the ``baseline`` method at the same length."""
    reference = table[table.method == baseline].set_index("length")
    return table.assign(
        **{
            f"time_vs_{baseline}": table.seconds / table.length.map(reference.seconds),
            f"memory_vs_{baseline}": table.peak_mib / table.length.map(reference.peak_mib),
        }
    )


def intervals(table: pd.DataFrame, by: list[str], measures: list[str]) -> pd.DataFrame:
    """Each measure's mean over a group's rows (samples) with its 95 % bootstrap interval
    (:func:`probe.stats.bootstrap`), one row per group of ``by`` and measure: columns ``*by``,
    ``measure``, ``mean``, ``low``, ``high``, ``samples`` (those with a value)."""
    from probe.stats import bootstrap

    rows = []
    for keys, group in table.groupby(by):
        for measure in measures:
            found = bootstrap(group[measure].to_numpy())
            rows.append({**dict(zip(by, keys, strict=True)), "measure": measure, "mean": found.value,
                         "low": found.low, "high": found.high, "samples": found.n})  # fmt: skip
    return pd.DataFrame(rows)


def report(table: pd.DataFrame, csv: Path | None) -> pd.DataFrame:
    """Print the table and, if asked, write it as CSV (atomically)."""
    print(table.round(3).to_string(index=False))
    if csv:
        atomic_write(csv, lambda tmp: table.to_csv(tmp, index=False))
    return table


def report_with_summary(table: pd.DataFrame, summary: pd.DataFrame, csv: Path | None) -> pd.DataFrame:
    """:func:`report` of a per-sample ``table`` to ``csv`` and of its ``summary`` to ``{csv}_summary.csv``
    beside it (only the summary is printed); the summary."""
    if csv:
        atomic_write(csv, lambda tmp: table.to_csv(tmp, index=False))
    return report(summary, csv.with_name(f"{csv.stem}_summary.csv") if csv else None)


def bench_parser(doc: str, methods: tuple[str, ...], lengths: list[int]) -> argparse.ArgumentParser:
    """The options every child-process benchmark takes; scripts add their own on top."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=lengths)
    parser.add_argument("--methods", nargs="+", choices=methods, default=list(methods))
    parser.add_argument("--csv", type=Path, default=None, help="also write the table here")
    add_device_arguments(parser)
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)
    return parser


def saved_passes_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a script that reads held-out studies' saved passes (no model runs): the study folders
    and the masks the studies drew (``--masks``, ``--ceiling-masks``, ``--mask-seed``: see
    :func:`study_masks`); scripts add their own on top."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("studies", type=Path, nargs="+", help="held-out study folders (finished or running)")
    parser.add_argument("--masks", type=int, default=32, help="the studies' LDS masks (--masks)")
    parser.add_argument("--ceiling-masks", type=int, default=256, help="the studies' --ceiling-masks")
    parser.add_argument("--mask-seed", type=int, default=5000, help="the studies' --seed (their masks' seed)")
    parser.add_argument("--csv", type=Path, default=None, help="the per-sample table; its summary beside it")
    return parser


def study_masks(n_sources: int, n_masks: int, ceiling_masks: int, seed: int) -> tuple:
    """The masks a held-out study judged a sample of ``n_sources`` sources on, each BoolTensor[masks,
    sources] (True = kept): its ``n_masks`` LDS masks and the ``ceiling_masks`` it fit the additive
    ceiling on (none for a study run with ``--ceiling-masks 0``), drawn as
    :func:`probe.faithfulness.evaluate` draws them from the study's ``seed``."""
    from probe import faithfulness

    kept_lds = faithfulness.random_masks(n_sources, n_masks, 0.5, seed)
    return kept_lds, faithfulness.additive_ceiling_masks(kept_lds, ceiling_masks, seed=seed)


def samples_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a one-process benchmark over samples; the defaults are the main job's samples
    (SmolLM2-135M, multihop-1 and multihop-2 at 1K tokens, seeds 0–11)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", nargs="+", default=["multihop-1", "multihop-2"])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(12)))
    parser.add_argument("--csv", type=Path, default=None, help="also write the table here")
    parser.add_argument(
        "--journal", type=Path, default=None,
        help="keep every masked pass in this folder as it finishes, so that a killed run goes on where it "
        "stopped (a script that runs its work under journaled())",
    )  # fmt: skip
    add_device_arguments(parser)
    return parser


def journaled(args: argparse.Namespace, script: str) -> contextlib.AbstractContextManager:
    """``with journaled(args, "name"):`` keeps every masked pass (:func:`probe.faithfulness.answer_scores`)
    under ``--journal`` in a :class:`probe.journal.Journal` named by the script, model and dtype (a pass's
    key names its sample, target and way of removal, not the model), and reads back those a killed run
    finished; without ``--journal``, nothing."""
    if args.journal is None:
        return contextlib.nullcontext()
    return Journal(args.journal / f"{script}_{Path(args.model).name}_{args.dtype or 'own-dtype'}")


def new_seed_samples(
    doc: str,
    argv: list[str] | None = None,
    task_names: tuple[str, ...] = ("multihop-2", "document-2"),
    seeds: range = range(20000, 20006),
    parser: argparse.ArgumentParser | None = None,
):
    """A check judged outside the held-out study (its samples may prompt a question, never answer it):
    :func:`samples_parser`'s options with new seeds by default (``task_names`` × ``seeds``), one thread.
    Returns ``(args, model, tokenizer, samples)``; ``samples`` yields ``(task, seed, Sample)``, each
    made when it is reached. ``parser``: :func:`samples_parser` with a script's own options added."""
    import torch

    from probe import tasks

    parser = parser or samples_parser(doc)
    parser.set_defaults(tasks=list(task_names), seeds=list(seeds))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load(args.model, args.device, args.dtype, args.tokenizer)
    samples = (
        (task, seed, tasks.make(task, tokenizer, args.length, seed=seed, model=model))
        for task in args.tasks
        for seed in args.seeds
    )
    return args, model, tokenizer, samples


def run_bench(
    args: argparse.Namespace,
    module: str,
    forwarded: list[str],
    child: Callable[[str, int], dict],
    baseline: str,
) -> pd.DataFrame:
    """In a child: measure ``child(method, length)`` and print it. In the parent: run every
    (method, length) as a child with ``forwarded`` options, add ratios to ``baseline``, report."""
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return pd.DataFrame()
    jobs = [(method, length) for length in args.lengths for method in args.methods]
    table = run_children(module, ["--model", args.model, *device_arguments(args), *forwarded], jobs)
    return report(add_ratios(table, baseline) if baseline in args.methods else table, args.csv)
