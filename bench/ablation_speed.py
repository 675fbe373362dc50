"""Leave-one-out ablation: reusing the unmasked prefix's KV cache vs re-running every masked pass.

Each (method, length) runs in its own child process (``bench/harness.py``) on the same sample
(``multihop-1`` at the given prompt length, seed 0) and computes the same thing: the gold answer's
log-probability with nothing removed and with each source removed in turn (key masking,
:func:`probe.faithfulness.answer_scores`), i.e. the :func:`probe.detectors.leave_one_out` detector.

- ``naive``: every masked pass runs the whole sequence;
- ``prefix``: the unmasked prefix before each pass's first removed token is run once, in order,
  and each pass starts from a copy of its KV cache (exact: same log-probabilities);
- ``prefix_batch4``: the same, four masks per forward.

    python bench/ablation_speed.py                        # SmolLM2-135M at 1K tokens
    python bench/ablation_speed.py --lengths 1024 2048 --csv bench/results/ablation_speed.csv
"""

from __future__ import annotations

import functools

import pandas as pd
from harness import bench_parser, measure, run_bench

METHODS = ("naive", "prefix", "prefix_batch4")


def _run_child(method: str, length: int, model_name: str, threads: int) -> dict:
    """Score every leave-one-out mask once in this (fresh) process; return time, memory, a checksum."""
    import torch

    import probe
    from probe import faithfulness, tasks

    torch.set_num_threads(threads)
    model, tokenizer = probe.load_model(model_name)
    sample = tasks.make("multihop-1", tokenizer, length, seed=0)
    n_sources = len(sample.sources)
    removed = torch.cat([torch.zeros(1, n_sources, dtype=torch.bool), torch.eye(n_sources, dtype=torch.bool)])
    settings = {
        "naive": dict(reuse_prefix=False),
        "prefix": dict(reuse_prefix=True),
        "prefix_batch4": dict(reuse_prefix=True, batch_size=4),
    }[method]

    def run():
        return faithfulness.answer_scores(model, sample, removed, **settings)

    def warm_up():
        faithfulness.answer_scores(model, sample, removed[:2])

    stats, result = measure(run, warm_up)
    return {**stats, "passes": len(removed), "logprob_sum": float(result.logprob.sum())}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = bench_parser(__doc__, METHODS, [1024])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    child = functools.partial(_run_child, model_name=args.model, threads=args.threads)
    return run_bench(args, __file__, ["--threads", str(args.threads)], child, "naive")


if __name__ == "__main__":
    main()
