"""ContextCite (``context-cite`` 0.0.4, MadryLab) on longprobe's exported samples, in its own environment.

    .venv-peers/context_cite/bin/python -m analyses.peers.context_cite.run EXPORTED.jsonl SCORES.jsonl

Each sample is ContextCite's own ``ContextCiter`` with its defaults (64 ablations, each source kept with
probability 1/2, its LASSO surrogate with alpha 0.01 on the logit-probability of the whole response),
changed only where the exchange requires (NOTES.md): the sources are longprobe's exported character
spans (:class:`SpanPartitioner`, not nltk's sentence splitter), the prompt is the exported one (chat
template already in it, so :class:`ExportedCiter` tokenizes it as it is instead of wrapping it in
ContextCite's prompt template and the chat template again), and the response is the exported answer,
teacher-forced (set in ContextCite's output cache instead of generated).
"""

from __future__ import annotations

import numpy as np
import torch
from context_cite import ContextCiter
from context_cite.context_partitioner import BaseContextPartitioner
from transformers import AutoModelForCausalLM, AutoTokenizer

from .. import peer_io


class SpanPartitioner(BaseContextPartitioner):
    """The whole prompt as ContextCite's "context", partitioned into the exported source spans. Removing a
    source removes its characters and the whitespace just before it (ContextCite's own partitioner drops
    a part with the separator before it); the text between sources that is no source always stays."""

    def __init__(self, context: str, spans: list[list[int]]) -> None:
        super().__init__(context)
        self.spans = [(start, end) for start, end in spans]

    @property
    def num_sources(self) -> int:
        return len(self.spans)

    def split_context(self) -> None:
        """Nothing to split: the sources are given."""

    def get_source(self, index: int) -> str:
        start, end = self.spans[index]
        return self.context[start:end]

    def get_context(self, mask: np.ndarray | None = None) -> str:
        """The prompt with the sources where ``mask`` is False removed."""
        return self.context if mask is None else peer_io.cut_out(self.context, self.spans, mask)


class ExportedCiter(ContextCiter):
    """ContextCiter on an already templated prompt: the (ablated) prompt is tokenized as it is."""

    def _get_prompt_ids(self, mask: np.ndarray | None = None, return_prompt: bool = False):
        prompt = self.partitioner.get_context(mask)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return (ids, prompt) if return_prompt else ids


def load(folder: str) -> tuple:
    """The exported model folder with this environment's transformers, float32, and its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"  # as ContextCiter.from_pretrained sets it
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    args = peer_io.arguments(argv=argv)
    torch.set_num_threads(args.threads)
    loaded = {folder: load(folder) for folder in peer_io.model_folders(args.exported)}  # before the clock

    def score(sample: dict) -> list[float]:
        model, tokenizer = loaded[sample["model"]]
        sample = peer_io.written_out(tokenizer, sample)  # Gemma 3's <bos>: ContextCite reads text alone
        prompt = sample["prompt"]
        partitioner = SpanPartitioner(prompt, sample["sources"])
        citer = ExportedCiter(model, tokenizer, prompt, query="", partitioner=partitioner)
        citer._cache["output"] = sample["text"]  # the teacher-forced answer, instead of generating one
        prompt_ids = citer._get_prompt_ids()
        text_ids = citer._output_tokens["input_ids"]
        if text_ids[: len(prompt_ids)] != prompt_ids or len(text_ids) == len(prompt_ids):
            raise ValueError("the text's tokens do not start with the prompt's and end with the answer's")
        return citer.get_attributions(verbose=False).tolist()

    peer_io.run(args, score)


if __name__ == "__main__":
    main()
