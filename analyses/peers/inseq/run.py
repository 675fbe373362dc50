"""inseq 0.7.1 (Sarti et al., ACL 2023 demo) as a peer: one score per source of each exported sample.

    .venv-peers/inseq/bin/python -m analyses.peers.inseq.run EXPORTED.jsonl SCORES.jsonl \
        --method {attention,saliency,input_x_gradient,integrated_gradients}

Calls inseq as its documentation does for a decoder-only model with a given output:
``inseq.load_model(folder, method)`` then ``model.attribute(input_texts=prompt, generated_texts=text)``
(``text`` = prompt + teacher-forced answer), with inseq's own target (the default step function,
``probability`` of each answer token) and defaults (integrated gradients: captum's 50 steps, baseline =
the UNK embedding; attention: every layer and head). The per-answer-token attributions get inseq's
default aggregation (``.aggregate()``: L2 norm over the embedding dimension for the gradient methods,
mean over layers then heads for attention; then each answer token's column L1-normalised over the
prefix), are summed over the answer tokens (attributed one at a time, each journaled), then over each
source's tokens (see NOTES.md).
"""

from __future__ import annotations

from functools import cache, partial

import inseq
import torch
from torch.nn.utils.rnn import pad_sequence

from .. import peer_io

METHODS = ["attention", "saliency", "input_x_gradient", "integrated_gradients"]
# Arguments for integrated gradients: captum's internal batch, how many of the 50 interpolated inputs go
# through the model at once. It changes memory, never the result (50 inputs of 1K tokens at once need
# > 24 GiB). The step count stays inseq's (captum's) default of 50.
IG_ARGS = {"internal_batch_size": 2}


@cache
def attribution_model(folder: str, method: str):
    """inseq's wrapper of one exported model folder (float32 on CPU, inseq's default eager attention)."""
    return inseq.load_model(folder, method, model_kwargs={"dtype": torch.float32})


def answer_token_scores(model, prompt: str, text: str, method: str, position: int) -> list[float]:
    """inseq's attribution of the answer token at ``position`` of ``text`` (after ``prompt``): one score
    per position that inseq returns, [positions].

    inseq attributes a forced answer one step (answer token) at a time, each step its own computation;
    ``attr_pos_start`` / ``attr_pos_end`` ask for one step, so a run killed inside a long answer keeps the
    steps it finished (:class:`peer_io.StepJournal`). Row i of inseq's matrix is position i of the
    model's input. inseq's token list is not used: it drops every token spelled like the pad token
    (SmolLM2: ``<|im_end|>``, also the chat template's turn end), then cuts the matrix to that shorter
    length, so the last rows go and the labels shift (NOTES.md).
    """
    extra = IG_ARGS if method == "integrated_gradients" else {}
    output = model.attribute(
        input_texts=prompt, generated_texts=text, attr_pos_start=position, attr_pos_end=position + 1,
        show_progress=False, **extra,
    )  # fmt: skip
    aggregated = output.sequence_attributions[0].aggregate()  # inseq's default: [positions, answer tokens]
    return aggregated.target_attributions.nan_to_num(0.0).sum(dim=1).tolist()


def token_scores(
    model, prompt: str, text: str, method: str, journal: peer_io.StepJournal, key: str
) -> list[float]:
    """inseq's attributions of every answer token of ``text``, summed: one score per position, [positions]."""
    start, end = (model.encode(part).input_ids.shape[1] for part in (prompt, text))
    per_answer_token = [
        torch.tensor(
            journal.step(key, position, partial(answer_token_scores, model, prompt, text, method, position))
        )
        for position in range(start, end)
    ]
    return pad_sequence(per_answer_token, batch_first=True).sum(dim=0).tolist()  # rows inseq left out: 0


def score(sample: dict, method: str, journal: peer_io.StepJournal) -> list[float]:
    """inseq ``method``'s token scores for the teacher-forced answer, summed over each source."""
    model = attribution_model(sample["model"], method)
    prompt, text = sample["prompt"], sample["text"]
    per_token = token_scores(model, prompt, text, method, journal, sample["key"])
    # The tokenizer's own special tokens, as longprobe reads a text without chat template (Gemma 3: <bos>)
    encoded = model.tokenizer(text, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], [tuple(pair) for pair in encoded["offset_mapping"]]
    read = model.encode(text).input_ids[0].tolist()  # what inseq fed the model (a doubled BOS removed)
    if read == ids[1:]:
        ids, offsets = ids[1:], offsets[1:]
    if read != ids:
        raise ValueError(f"inseq read {len(read)} tokens, the tokenizer gives {len(ids)}")
    offsets = [(start, end if end > start else start) for start, end in offsets]
    totals = [0.0] * len(sample["sources"])
    for position, owner in enumerate(peer_io.source_of_token(offsets, text, sample["sources"])):
        if owner is None or offsets[position][0] == offsets[position][1]:  # outside, or an added token
            continue
        if position >= len(per_token):
            raise ValueError(f"source {owner} holds position {position}: inseq scored {len(per_token)}")
        totals[owner] += per_token[position]
    return totals


def main(argv: list[str] | None = None) -> None:
    """Score every exported sample with ``--method`` (peer_io's command line)."""
    args = peer_io.arguments(METHODS, argv=argv)
    torch.set_num_threads(args.threads)
    for folder in peer_io.model_folders(args.exported):
        attribution_model(folder, args.method)  # load before the clock starts
    journal = peer_io.StepJournal(args.out)
    peer_io.run(args, lambda sample: score(sample, args.method, journal), journal)


if __name__ == "__main__":
    main()
