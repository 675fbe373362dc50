"""Where the key-removal gradient looks: the answer rows the model is sure of against those it is not.

Prompted by the held-out study (issue 36, item 5): on Qwen2.5's `kv` 5001 at 4K `key_removal_grad` ranks
first a source whose removal *raises* the answer, while removing the answer's own source costs 94.7 nats.
The gradient of Σ_t log p_t is Σ_t (1 − p_t)-weighted: a row the model copies with p_t → 1 adds almost
nothing to it, however much it falls when its source is gone. This script splits one sample's answer rows
at p_t ≥ ``--sure`` into ``sure`` and ``unsure`` and reports, for chosen sources and for each group
(:class:`RowGroup` as the :mod:`probe.target`):

- ``first_order``: the key-removal gradient (:func:`probe.probes.key_removal.key_removal_gradient`, token
level as
  ``key_removal_grad``) summed over the source's tokens: its first-order removal effect;
- ``first_order_unit``: the same with the source removed as a unit (``sources=``, a query inside the source
  gets no bias on it; ``key_removal_banzhaf(presence=1)``): the slope at 0 of the ``curve_`` columns;
- ``removal``: the exact effect of removing the source (:func:`probe.faithfulness.leave_one_out_drops`),
  log P(full) − log P(source removed);
- ``curve_<d>`` (whole answer only): the exact effect of lowering the source's key bias by ``d`` from every
  later query outside the source (:func:`banzhaf_gap.bias_curve` at presence 1; ``d`` = 30 is about the
  removal): how far along the path the first-order slope holds.

Sources: ``--sources`` (indices), by default the sample's ``supporting`` ones and ``key_removal_grad``'s
top one. A diagnosis, not a verdict: it explains one sample; a fix is judged on new seeds. One thread.

    python -m analyses.key_removal_saturation --model qwen2.5-coder-0.5b --task kv --length 4096 \\
        --seed 5001 --csv bench/results/key_removal_saturation_qwen2.5-coder-0.5b-4096-kv-5001.csv
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from bench.harness import add_device_arguments, load, report
from probe import faithfulness, tasks
from probe.probes.key_removal import key_removal_gradient
from probe.probes.logprobs import long_logprobs
from probe.target import answer_logprob

from .banzhaf_gap import DROPS, bias_curve


@dataclass(frozen=True)
class RowGroup:
    """Σ_t log p_t over the answer rows flagged in ``rows`` (BoolTensor[k]); a :mod:`probe.target`."""

    rows: torch.Tensor

    def __call__(self, logits: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
        rows = self.rows.to(logits.device)
        return answer_logprob(logits[rows], answer.to(logits.device)[rows])


def answer_rows(model, sample: tasks.Sample) -> torch.Tensor:
    """log p_t of each answer token in the full context: Tensor[k]."""
    return long_logprobs(model, sample.input_ids, sample.target_positions).target[sample.target_positions]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--task", default="kv")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=5001)
    parser.add_argument("--sources", type=int, nargs="*", default=None, help="source indices to report")
    parser.add_argument("--sure", type=float, default=0.9, help="p_t at or above which a row is sure")
    parser.add_argument("--csv", type=Path, default=None, help="also write the table here")
    add_device_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load(args.model, args.device, args.dtype)
    sample = tasks.make(args.task, tokenizer, args.length, args.seed, model=model)
    full = answer_rows(model, sample)
    sure = full >= torch.log(torch.tensor(args.sure))
    groups = {"whole": torch.ones_like(sure), "sure": sure, "unsure": ~sure}
    print(f"{len(full)} answer rows, {int(sure.sum())} sure; log P {float(full.sum()):.2f}")

    def by_group(measure: Callable[[RowGroup], torch.Tensor]) -> dict[str, torch.Tensor]:
        """``measure`` of the sure and of the unsure rows; the whole answer's is their sum (every
        measure here is linear in the target, a sum over rows)."""
        parts = {name: measure(RowGroup(groups[name])) for name in ("sure", "unsure")}
        return {"whole": parts["sure"] + parts["unsure"], **parts}

    spans = [(one.start, one.end) for one in sample.sources]
    first_order, first_order_unit = (
        by_group(
            lambda target, units=units: faithfulness.source_scores(
                key_removal_gradient(
                    model, sample.input_ids, sample.target_positions, target=target, sources=units
                ),
                sample.sources,
                "sum",
            )
        )
        for units in (None, spans)
    )
    chosen = args.sources
    if chosen is None:
        supporting = [i for i, one in enumerate(sample.sources) if one.category == "supporting"]
        top = int(first_order["whole"].argmax())
        chosen = list(dict.fromkeys([*supporting, top]))
    removal = by_group(
        lambda target: faithfulness.leave_one_out_drops(
            model, sample, chosen, faithfulness.Passes(target=target)
        )[0]
    )
    rows = []
    for name, group in groups.items():
        for at, source in enumerate(chosen):
            rows.append({"source": source, "category": sample.sources[source].category, "rows": name,
                         "n_rows": int(group.sum()), "first_order": float(first_order[name][source]),
                         "first_order_unit": float(first_order_unit[name][source]),
                         "removal": float(removal[name][at]), "first_order_rank": int((first_order[name] >
                         first_order[name][source]).sum()) + 1})  # fmt: skip
    table = pd.DataFrame(rows)
    for source in chosen:
        curve = bias_curve(model, sample, source, presence=1.0)
        where = (table.source == source) & (table.rows == "whole")
        for drop, value in zip(DROPS[1:], curve[1:], strict=True):
            table.loc[where, f"curve_{drop:g}"] = curve[0] - value
    table = table.assign(model=args.model, task=args.task, length=args.length, seed=args.seed)
    return report(table, args.csv)


if __name__ == "__main__":
    main()
