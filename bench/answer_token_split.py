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
"""

from __future__ import annotations

import torch
from harness import new_seed_samples
from source_reduce import judged, paired, summarised

from probe import embedding_grad_norms, tasks
from probe.target import Target

TASKS = ("document-2", "kv", "key-token")  # answers of 2-3, ~33 and 1 token(s)
BASELINE = ("embedding_grad", "mean")  # longprobe's detector with its default reduction


def answer_token(t: int) -> Target:
    """The target log p(answer token ``t``) alone: ``(logits [k, vocab], answer [k]) -> 0-d``."""
    return lambda logits, answer: logits[t].log_softmax(-1)[answer[t]]


def split_saliency(model, sample: tasks.Sample) -> dict[str, torch.Tensor]:
    """Per answer token t its own gradient norm n_t,i = ‖∂ log p_t/∂e_i‖₂ (one backward pass each),
    summed over t: ``"split_saliency"`` Σ_t n_t,i / Σ_j n_t,j (inseq's aggregation) and
    ``"split_unnormalised"`` Σ_t n_t,i (which tells the split from the normalisation): Tensor[seq] each."""
    normalised = torch.zeros(len(sample.input_ids))
    unnormalised = torch.zeros(len(sample.input_ids))
    k = len(sample.target_positions)
    for t in range(k):
        norms = embedding_grad_norms(model, sample.input_ids, sample.target_positions, target=answer_token(t))
        norms = norms.float().cpu() * k  # the probe differentiates −log p_t / k: back to log p_t
        unnormalised += norms
        normalised += norms / norms.sum()
    return {"split_saliency": normalised, "split_unnormalised": unnormalised}


def main(argv: list[str] | None = None):
    args, model, _, samples = new_seed_samples(__doc__, argv, TASKS, range(21000, 21004))
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
