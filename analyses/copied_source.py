"""Which detector ranks a copied answer's source first? Judged on new seeds.

Prompted by the held-out study (RESULTS.md, "Why the key-removal gradient misses a copied answer's
source"): on `kv` the answer is copied from one source (its ``supporting`` span), whose removal costs
60–130 nats; on 6 of the 24 held-out `kv` samples `key_removal_grad` ranked another source first, while
`attn_lrp` and `information_flow` never did. The explanation (`analyses/key_removal_saturation.py`: a slope
at b = 0 misses the step of a source the model copies with p → 1) predicts the same on samples nobody
looked at. Per sample and detector: its top source (the detector's own source scores, as
:meth:`~probe.detectors.registry.Detection.source_scores` gives them), the exact effect of removing it and
of removing the answer's source (:func:`probe.faithfulness.leave_one_out_drops`, one pass each after a
shared prefix), and ``hit``: its top source is the answer's. The summary counts hits per detector.

Defaults: Qwen2.5-Coder-0.5B, `kv` at 4K, seeds 24000–24005 (6 samples), one thread:

    python -m analyses.copied_source --csv bench/results/copied_source_qwen2.5-coder-0.5b-4096.csv
"""

from __future__ import annotations

import pandas as pd

from bench.harness import new_seed_samples, report_with_summary, samples_parser
from probe import faithfulness
from probe.detectors import detect_many

DETECTORS = ("key_removal_grad", "key_removal_banzhaf", "attn_lrp", "information_flow", "attention")


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = samples_parser(__doc__)
    parser.set_defaults(model="qwen2.5-coder-0.5b", length=4096)
    parser.add_argument("--detectors", nargs="+", default=list(DETECTORS))
    args, model, tokenizer, samples = new_seed_samples(__doc__, argv, ("kv",), range(24000, 24006), parser)
    rows = []
    for task, seed, sample in samples:
        found = detect_many(args.detectors, model, tokenizer, sample)
        tops = {name: int(detection.source_scores(sample).argmax()) for name, detection in found.items()}
        answer = [i for i, source in enumerate(sample.sources) if source.category == "supporting"]
        measured = sorted(set(tops.values()) | set(answer))
        drops, _ = faithfulness.leave_one_out_drops(model, sample, measured)
        lost = dict(zip(measured, drops.tolist(), strict=True))
        for name, top in tops.items():
            rows.append({"model": args.model, "length": args.length, "task": task, "seed": seed,
                         "detector": name, "top_source": top, "top_removal": lost[top],
                         "answer_removal": max(lost[i] for i in answer), "hit": top in answer,
                         "seconds": found[name].seconds})  # fmt: skip
        print(pd.DataFrame(rows[-len(tops) :]).round(2).to_string(index=False), flush=True)
    table = pd.DataFrame(rows)
    summary = table.groupby("detector", sort=False).agg(hits=("hit", "sum"), samples=("hit", "size"))
    return report_with_summary(table, summary.reset_index(), args.csv)


if __name__ == "__main__":
    main()
