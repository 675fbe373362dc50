"""inseq's saliency aggregation on longprobe's gradient: one gradient per answer token, each normalised,
judged by exact ablation on new seeds.

Prompted by the peers' run (issue 37, item 4): inseq 0.7.1's ``saliency`` reached a higher LDS than
longprobe's ``embedding_grad`` on the held-out SmolLM2 samples, and its summing of token scores over a
source does not explain it (``bench/source_reduce.py``: the sum is worse than the mean on new seeds).
What is left is how the two treat an answer of several tokens (``bench/peers/inseq/NOTES.md``):

- ``embedding_grad``: ‖∂L/∂e_i‖₂, L the answer's whole loss (one gradient of the summed log-probability);
- ``split_saliency``: Σ_t ‖∂ log p_t/∂e_i‖₂ / Σ_j ‖∂ log p_t/∂e_j‖₂ — each answer token t gets its own
  gradient, L1-normalised over the positions, and the answer tokens are summed. This is inseq's
  ``saliency`` → ``aggregate()`` → sum over answer tokens (its probability target p_t differs from
  log p_t by the factor p_t, which the normalisation cancels). For a one-token answer the two rank
  tokens identically; only the reduction to sources then differs.
- ``split_unnormalised``: Σ_t ‖∂ log p_t/∂e_i‖₂ — the split without the normalisation, to tell which
  of the two matters.

All three are reduced mean / sum / max and judged on the same 32 random half masks (LDS) and top-k masks
(k = 1, 4) as in ``bench/source_reduce.py``; paired differences from ``embedding_grad`` with the mean
reduction (longprobe's default), 95 % bootstrap intervals over samples. Defaults: SmolLM2-135M at 1K,
``document-2``, ``kv`` and ``key-token``, seeds 21000–21003 (12 samples), one thread:

    python bench/answer_token_split.py --csv bench/results/answer_token_split.csv
    python bench/answer_token_split.py --tokens --tasks document-2 \\
        --csv bench/results/answer_token_split_tokens.csv
"""

from __future__ import annotations

import pandas as pd
import torch
from harness import new_seed_samples, report, samples_parser
from source_reduce import judged, paired, summarised

from probe import embedding_grad_norms, tasks
from probe.logprobs import long_logprobs
from probe.target import AnswerToken

TASKS = ("document-2", "kv", "key-token")  # answers of 3–5, ~33 and 1 token(s)
BASELINE = ("embedding_grad", "mean")  # longprobe's detector with its default reduction


def answer_token_norms(model, sample: tasks.Sample) -> torch.Tensor:
    """n_t,i = ‖∂ log p_t/∂e_i‖₂ for each answer token t alone: Tensor[k, seq] (one backward pass each)."""
    k = len(sample.target_positions)
    rows = [
        embedding_grad_norms(model, sample.input_ids, sample.target_positions, target=AnswerToken(t))
        for t in range(k)
    ]
    return torch.stack(rows).float().cpu() * k  # the probe differentiates −log p_t / k: back to log p_t


def split_saliency(model, sample: tasks.Sample) -> dict[str, torch.Tensor]:
    """The answer tokens' own gradient norms n_t,i summed over t: ``"split_saliency"``
    Σ_t n_t,i / Σ_j n_t,j (inseq's aggregation) and ``"split_unnormalised"`` Σ_t n_t,i (which tells
    the split from the normalisation): Tensor[seq] each."""
    norms = answer_token_norms(model, sample)
    return {
        "split_saliency": (norms / norms.sum(dim=1, keepdim=True)).sum(dim=0),
        "split_unnormalised": norms.sum(dim=0),
    }


def answer_tokens(model, tokenizer, task: str, seed: int, sample: tasks.Sample) -> pd.DataFrame:
    """One row per answer token: its text, p_t in full context, its gradient mass Σ_i n_t,i and the
    context's share of it, beside the whole answer's gradient mass (that of Σ_t log p_t)."""
    answer = sample.input_ids[sample.target_positions]
    p = long_logprobs(model, sample.input_ids, sample.target_positions).target[sample.target_positions].exp()
    norms = answer_token_norms(model, sample)
    k = len(answer)
    whole = embedding_grad_norms(model, sample.input_ids, sample.target_positions).float().sum().item() * k
    return pd.DataFrame(
        {
            "task": task,
            "seed": seed,
            "t": range(k),
            "token": [tokenizer.decode(i) for i in answer],
            "p": p.tolist(),
            "gradient_mass": norms.sum(dim=1).tolist(),
            "context_share": (norms[:, : sample.prompt_length].sum(dim=1) / norms.sum(dim=1)).tolist(),
            "whole_gradient_mass": whole,
        }
    )


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = samples_parser(__doc__)
    parser.add_argument(
        "--tokens", action="store_true", help="only the per-answer-token table (answer_tokens), no judging"
    )
    args, model, tokenizer, samples = new_seed_samples(__doc__, argv, TASKS, range(21000, 21004), parser)
    if args.tokens:
        table = pd.concat([answer_tokens(model, tokenizer, *one) for one in samples], ignore_index=True)
        return report(table, args.csv)
    rows = []
    for task, seed, sample in samples:
        whole = embedding_grad_norms(model, sample.input_ids, sample.target_positions).float().cpu()
        rows.append(
            judged(model, task, seed, sample, {"embedding_grad": whole, **split_saliency(model, sample)})
        )
    table = summarised(rows, args.csv, against=BASELINE)
    for task, part in table.groupby("task"):
        by_task = paired(part, BASELINE)
        print(f"{task}:", by_task[by_task.metric == "lds"].round(3).to_string(index=False), sep="\n")
    return table


if __name__ == "__main__":
    main()
