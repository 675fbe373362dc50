"""AT2 (``at2`` 0.0.1, MadryLab) on longprobe's exported samples, in its own environment.

    .venv-peers/at2/bin/python -m analyses.peers.at2.run EXPORTED.jsonl SCORES.jsonl \
        [--estimator analyses/peers/at2/estimators/smollm2-135m.pt]

Each sample is an AT2 attribution task (:class:`ExportedTask`, an ``at2.tasks.AttributionTask``) scored
by AT2's own ``AT2Attributor`` with a score estimator trained by AT2's own trainer (``train.py``; the
published ones come from the Hugging Face hub, unreachable here). AT2's features: every head's attention
weights from the answer's tokens to each token (``AT2FeatureExtractor``), summed over a source's tokens;
a source's score is the estimator's linear map of them, averaged over the answer's tokens.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch
from at2 import AT2Attributor, AT2FeatureExtractor, AT2ScoreEstimator
from at2.tasks import AttributionTask

from .. import legacy, peer_io

here = Path(__file__).resolve().parent

ESTIMATORS = here / "estimators"
#: config.json's model_type -> AT2's name for it (``at2.attribution.attention``: Gemma 3 is "gemma3")
MODEL_TYPES = {"gemma3_text": "gemma3"}


class ExportedTask(AttributionTask):
    """One exported sample as an AT2 task: the exported prompt (chat template included) is the input,
    the exported answer the generation (teacher-forced), the sources longprobe's spans mapped to tokens by
    longprobe's span rule (``peer_io.source_of_token``). ``source_type="token"`` makes every token of
    every span a source of its own (as AT2's training script does with its context), ``"span"`` one
    source per span."""

    def __init__(self, sample: dict, model, tokenizer, source_type: str = "span") -> None:
        super().__init__(model, tokenizer)
        self.sample = peer_io.written_out(tokenizer, sample)  # Gemma 3's <bos>: AT2 tokenizes text alone
        self.source_type = source_type
        self.set_generation(self.sample["text"][len(self.sample["prompt"]) :])
        if (
            self.get_tokens()["input_ids"][: self.generation_token_start]
            != self.get_input_tokens()["input_ids"]
        ):
            raise ValueError("the text's tokens do not start with the prompt's")
        if self.has_empty_target:
            raise ValueError("the answer has no token of its own after the prompt's tokens")

    @property
    def input_text(self) -> str:
        return self.sample["prompt"]

    @property
    def target_token_range(self) -> tuple[int, int]:
        return self.generation_token_start, self.generation_token_end

    def _get_source_token_ranges(self) -> list[tuple[int, int]]:
        tokens = self.tokenizer(self.text, add_special_tokens=False, return_offsets_mapping=True)
        owner = peer_io.source_of_token(tokens["offset_mapping"], self.text, self.sample["sources"])
        positions = [[t for t, o in enumerate(owner) if o == n] for n in range(len(self.sample["sources"]))]
        if any(not p or p[-1] - p[0] + 1 != len(p) for p in positions):
            raise ValueError("a source owns no token or tokens that are not contiguous")
        if self.source_type == "token":
            return [(t, t + 1) for p in positions for t in p]
        return [(p[0], p[-1] + 1) for p in positions]


def feature_extractor(model) -> AT2FeatureExtractor:
    """AT2's attention features for ``model``; its model type given, since AT2 infers it from the model's
    name and our converted folder's name says no architecture."""
    config = model.config
    model_type = MODEL_TYPES.get(config.model_type, config.model_type)
    return AT2FeatureExtractor(config.num_hidden_layers, config.num_attention_heads, model_type)


def load(folder: str) -> tuple:
    """The exported model folder with transformers 4.52 (``legacy``; NOTES.md: AT2's Gemma 3 code needs it),
    float32, and its tokenizer (set up as ``at2.utils.get_model_and_tokenizer`` does)."""
    model = legacy.model(folder, legacy.config(folder))
    tokenizer = legacy.tokenizer(folder)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--estimator", type=Path, default=None)
    known, rest = extra.parse_known_args(argv)
    args = peer_io.arguments(argv=rest)
    torch.set_num_threads(args.threads)
    loaded = {}  # every model and its estimator, before the clock starts
    for folder in peer_io.model_folders(args.exported):
        path = known.estimator or ESTIMATORS / f"{Path(folder).name}.pt"
        print("estimator", path, hashlib.sha256(path.read_bytes()).hexdigest()[:12], flush=True)
        loaded[folder] = (*load(folder), AT2ScoreEstimator.load(path))

    def score(sample: dict) -> list[float]:
        model, tokenizer, estimator = loaded[sample["model"]]
        task = ExportedTask(sample, model, tokenizer)
        return AT2Attributor(task, estimator).get_attribution_scores().tolist()

    peer_io.run(args, score)


if __name__ == "__main__":
    main()
