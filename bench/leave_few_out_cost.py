"""Where ``leave_few_out``'s forward-pass equivalents go, pass by pass, in one process of one thread.

For each sample, every number in units of one plain forward pass over it (``forward``, best of two, the
unit of the studies' ``--time-forward``):

- ``forward_backward``: one forward+backward pass over every layer without a key bias
  (:func:`probe.probes.attribution.answer_attribution`): the floor of the weighted pass;
- ``weighted``: the weighted pass itself (:func:`probe.detectors.ablation.weighted_rankings`, every source's
  keys at presence ½), the key bias's cost the difference;
- ``removals``: the full context and each measured source removed alone, in one
  :func:`probe.faithfulness.answer_scores` call with the prefix reused. The full context costs one forward,
  a removal about what it recomputes: ``suffix`` is the sum, over the measured sources, of the share of the
  sequence from the source's first token on;
- ``head_check``: the joint removal of the ranking's head, in a call of its own (its prefix run again);
  ``head_check_shared``: what the same joint removal adds when it runs in the removals' call;
- ``leave_few_out``: the detector timed whole, beside the sum of its parts (``parts``).

    python -m bench.leave_few_out_cost --model smollm2-135m --tasks kv document-2 multihop-4 key-token \\
        --seeds 7001 --csv bench/results/leave_few_out_cost_smollm2.csv
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import pandas as pd
import torch

from bench.harness import load, report, samples_parser
from probe import detectors, tasks
from probe.cost import forward_seconds
from probe.detectors.ablation import pruned_sources, weighted_rankings
from probe.faithfulness import answer_scores
from probe.probes.attribution import answer_attribution

SHOWN = ("forward_backward", "weighted", "removals", "suffix", "head_check", "head_check_shared", "parts",
         "leave_few_out")  # fmt: skip


def timed(run: Callable[[], object]) -> tuple[float, object]:
    """(wall seconds of ``run()``, what it returned)."""
    start = time.perf_counter()
    value = run()
    return time.perf_counter() - start, value


def split(model, tokenizer, sample: tasks.Sample) -> dict[str, float]:
    """One sample's costs (see the module's docstring), each in forward passes."""
    unit = forward_seconds(model, sample)
    default = functools.partial(detectors.option_default, "leave_few_out")
    spans = [(source.start, source.end) for source in sample.sources]
    ids, positions = sample.input_ids, sample.target_positions
    row = {"forward_backward": timed(lambda: answer_attribution(model, ids, positions))[0]}
    row["weighted"], (rankings, slope) = timed(
        lambda: weighted_rankings(model, sample, default("rank_by"), default("presence"))
    )
    chosen = pruned_sources(rankings, default("measure"))
    singles = torch.zeros(len(chosen) + 1, len(spans), dtype=torch.bool)  # the full context, then each
    singles[torch.arange(1, len(chosen) + 1), chosen] = True
    row["removals"], scores = timed(lambda: answer_scores(model, sample, singles))
    effect = slope.clone()
    effect[chosen] = scores.logprob[0] - scores.logprob[1:]
    together = torch.zeros(1, len(spans), dtype=torch.bool)
    together[0, torch.argsort(-effect, stable=True)[: default("check")]] = True
    row["head_check"] = timed(lambda: answer_scores(model, sample, together))[0]
    shared = timed(lambda: answer_scores(model, sample, torch.cat([singles, together])))[0]
    row["head_check_shared"] = shared - row["removals"]
    row["leave_few_out"] = timed(lambda: detectors.detect("leave_few_out", model, tokenizer, sample))[0]
    row["parts"] = row["weighted"] + row["removals"] + row["head_check"]
    starts = torch.tensor([spans[index][0] for index in chosen.tolist()], dtype=torch.float)
    suffix = float((1 - starts / len(ids)).sum())
    return {"tokens": len(ids), "sources": len(spans), "measured": len(chosen), "forward_seconds": unit,
            **{name: value / unit for name, value in row.items()}, "suffix": suffix}  # fmt: skip


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = samples_parser(__doc__)
    parser.set_defaults(tasks=["kv", "document-2", "multihop-4", "key-token"], seeds=[7001])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load(args.model, args.device, args.dtype, args.tokenizer)
    split(model, tokenizer, tasks.make("kv", tokenizer, 256, seed=0))  # warm-up
    rows = []
    for task in args.tasks:
        for seed in args.seeds:
            sample = tasks.make(task, tokenizer, args.length, seed, model=model)
            costs = split(model, tokenizer, sample)
            print(task, seed, {key: round(value, 2) for key, value in costs.items()}, flush=True)
            rows.append({"task": task, "seed": seed, **costs})
    table = pd.DataFrame(rows).assign(model=args.model)
    means = table[list(SHOWN)].mean().round(2).to_string()
    print(f"mean over {len(table)} samples, in forward passes:\n{means}")
    return report(table, args.csv)


if __name__ == "__main__":
    main()
