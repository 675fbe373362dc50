"""FlashTrace 0.1.1 (Pan et al., ICML 2026) as a peer: one score per source of each exported sample.

    .venv-peers/flashtrace/bin/python -m analyses.peers.flashtrace.run EXPORTED.jsonl SCORES.jsonl

Calls the package's public facade as its README does: ``FlashTrace(model, tokenizer)`` with its
defaults (``chunk_tokens=128``, ``sink_chunk_tokens=32``, no chat template: the exported prompt
already holds it) and ``trace(prompt=..., target=...)`` with its defaults (``method="flashtrace"``,
``hops=1``, every answer token as the output span). ``trace.scores`` (one per prompt token) are
summed over each source's tokens; FlashTrace's sentence aggregation was removed from the package
(see NOTES.md).
"""

from __future__ import annotations

from functools import cache

import torch
from flashtrace import FlashTrace, load_model_and_tokenizer

from .. import peer_io


@cache
def tracer(folder: str) -> FlashTrace:
    """The tracer for one exported model folder, loaded once: float32 on CPU, eager attention
    (FlashTrace reads the attention weights that ``output_attentions=True`` returns)."""
    model, tokenizer = load_model_and_tokenizer(
        folder, device_map=None, dtype="float32", attn_implementation="eager"
    )
    return FlashTrace(model, tokenizer)


def score(sample: dict) -> list[float]:
    """FlashTrace's prompt-token scores for the teacher-forced answer, summed over each source."""
    engine = tracer(sample["model"])
    # FlashTrace tokenizes without special tokens; longprobe reads a text without chat template with the
    # tokenizer's BOS (Gemma 3), so it is written out in front of the prompt (in no source)
    sample = peer_io.written_out(engine.tokenizer, sample)
    prompt, text = sample["prompt"], sample["text"]
    trace = engine.trace(prompt=prompt, target=text[len(prompt) :])  # the answer with its leading space
    encoded = engine.tokenizer(prompt, return_offsets_mapping=True, add_special_tokens=False)
    offsets = [tuple(pair) for pair in encoded["offset_mapping"]]
    if len(offsets) != len(trace.scores):
        raise ValueError(f"{len(trace.scores)} FlashTrace scores for {len(offsets)} prompt tokens")
    return peer_io.sum_by_source([float(value) for value in trace.scores], offsets, sample)


def main(argv: list[str] | None = None) -> None:
    """Score every exported sample (peer_io's command line)."""
    args = peer_io.arguments(argv=argv)
    torch.set_num_threads(args.threads)
    for folder in peer_io.model_folders(args.exported):
        tracer(folder)  # load before the clock starts: seconds are the attribution's alone
    peer_io.run(args, score)


if __name__ == "__main__":
    main()
