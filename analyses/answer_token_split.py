"""inseq's saliency aggregation on longprobe's gradient: one gradient per answer token, each normalised,
judged by exact ablation on new seeds.

Prompted by the peers' run (issue 37, item 4): inseq 0.7.1's ``saliency`` reached a higher LDS than
longprobe's ``embedding_grad`` on the held-out SmolLM2 samples, and its summing of token scores over a
source does not explain it (``analyses/source_reduce.py``: the sum is worse than the mean on new seeds).
What is left is how the two treat an answer of several tokens (``analyses/peers/inseq/NOTES.md``):

- ``embedding_grad``: ‖∂L/∂e_i‖₂, L the answer's whole loss (one gradient of the summed log-probability);
- ``split_saliency``: Σ_t ‖∂ log p_t/∂e_i‖₂ / Σ_j ‖∂ log p_t/∂e_j‖₂ — each answer token t gets its own
  gradient, L1-normalised over the positions, and the answer tokens are summed. This is inseq's
  ``saliency`` → ``aggregate()`` → sum over answer tokens (its probability target p_t differs from
  log p_t by the factor p_t, which the normalisation cancels). For a one-token answer the two rank
  tokens identically; only the reduction to sources then differs.
- ``split_unnormalised``: Σ_t ‖∂ log p_t/∂e_i‖₂ — the split without the normalisation, to tell which
  of the two matters.

All three are reduced mean / sum / max and judged on the same 32 random half masks (LDS) and top-k masks
(k = 1, 4) as in ``analyses/source_reduce.py``; paired differences from ``embedding_grad`` with the mean
reduction (longprobe's default), 95 % bootstrap intervals over samples. Defaults: SmolLM2-135M at 1K,
``document-2``, ``kv`` and ``key-token``, seeds 21000–21003 (12 samples), one thread:

    python -m analyses.answer_token_split --csv bench/results/answer_token_split.csv
    python -m analyses.answer_token_split --tokens --tasks document-2 \\
        --csv bench/results/answer_token_split_tokens.csv

``--detectors``: the same question for other detectors, on their own source scores (each detector's own
reduction: the mean, or the sum of an additive one). Per answer token t, the detector's source scores
under ``target=AnswerToken(t)`` (one shared pass per t for the detectors that read it), each
L1-normalised over the sources and summed over t (``{name}+split``), judged beside the detector's
whole-answer scores (``{name}``); ``{name}+split_unnormalised`` (the plain sum over t) is judged only
for detectors that are not linear in the target — for the additive ones (``grad_times_input``,
``key_removal_grad``, ``key_removal_banzhaf``) it equals the whole-answer score, which is checked.

    python -m analyses.answer_token_split --detectors embedding_grad information_flow grad_times_input \\
        key_removal_grad key_removal_banzhaf --csv bench/results/answer_token_split_detectors.csv
"""

from __future__ import annotations

import pandas as pd
import torch

from bench.harness import new_seed_samples, report, samples_parser
from probe import detectors, embedding_grad_norms, tasks
from probe.probes.logprobs import long_logprobs
from probe.target import AnswerToken

from .source_reduce import judged, judged_sources, paired, summarised

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


LINEAR = ("grad_times_input", "key_removal_grad", "key_removal_banzhaf")  # additive in the target


def split_source_scores(model, tokenizer, sample: tasks.Sample, names: list[str]) -> dict[str, torch.Tensor]:
    """Each detector's whole-answer source scores and their per-answer-token split: ``name``,
    ``name+split`` (Σ_t s_t / Σ_j |s_t,j|, s_t Tensor[sources] under ``AnswerToken(t)``) and, for a
    detector not in :data:`LINEAR`, ``name+split_unnormalised`` (Σ_t s_t): Tensor[sources] each."""

    def source_scores(target=None) -> dict[str, torch.Tensor]:
        options = {name: {"target": target} for name in names}
        found = detectors.detect_many(names, model, tokenizer, sample, options)
        return {name: found[name].source_scores(sample).float() for name in names}

    whole = source_scores()
    split = [source_scores(AnswerToken(t)) for t in range(len(sample.target_positions))]
    scores = {}
    for name in names:
        each = torch.stack([one[name] for one in split])  # [answer tokens, sources]
        scores[name] = whole[name]
        scores[f"{name}+split"] = (each / each.abs().sum(dim=1, keepdim=True)).sum(dim=0)
        if name in LINEAR:  # the k targets sum to the default: so do the gradients of an additive score
            torch.testing.assert_close(each.sum(dim=0), whole[name], atol=1e-4, rtol=1e-3)
        else:
            scores[f"{name}+split_unnormalised"] = each.sum(dim=0)
    return scores


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = samples_parser(__doc__)
    parser.add_argument(
        "--tokens", action="store_true", help="only the per-answer-token table (answer_tokens), no judging"
    )
    parser.add_argument(
        "--detectors", nargs="+", choices=detectors.names(), help="split these detectors' source scores"
    )
    args, model, tokenizer, samples = new_seed_samples(__doc__, argv, TASKS, range(21000, 21004), parser)
    if args.tokens:
        table = pd.concat([answer_tokens(model, tokenizer, *one) for one in samples], ignore_index=True)
        return report(table, args.csv)
    if args.detectors:
        rows, summary = [], []
        for task, seed, sample in samples:
            found = split_source_scores(model, tokenizer, sample, args.detectors)
            rows.append(
                judged_sources(model, task, seed, sample, {f"{name}/own": s for name, s in found.items()})
            )
        table = pd.concat(rows, ignore_index=True)
        for name in args.detectors:  # each scoring against its own detector's whole-answer scores
            against = paired(table, (name, "own"))
            summary.append(against[against.detector.str.split("+").str[0] == name])
        summary = pd.concat(summary)
        print(summary[summary.metric == "lds"].round(3).to_string(index=False))
        report(summary, args.csv.with_name(args.csv.stem + "_summary.csv") if args.csv else None)
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
