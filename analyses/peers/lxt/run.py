"""lxt 2.1 (AttnLRP, Achtibat et al. ICML 2024) as a peer of longprobe; runs in .venv-peers/lxt.

    .venv-peers/lxt/bin/python -m analyses.peers.lxt.run EXPORTED.jsonl SCORES.jsonl [--threads 1]

As lxt's README and examples call it: ``lxt.efficient.monkey_patch`` on the model family's transformers
module, a forward from the input embeddings, a backward from the target logit, relevance = input
embeddings × gradient summed over the hidden dimension. The target is the sum of the teacher-forced
answer tokens' logits (lxt explains one logit; the sum is what longprobe's ``attn_lrp`` explains). A
source scores the sum of its tokens' relevance. Choices and failures: NOTES.md beside this file.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import torch
import transformers  # noqa: F401  (first: it decides whether torchvision is installed before the stand-in)
from transformers import PreTrainedTokenizerFast

from .. import legacy, peer_io

#: config.json's model_type -> the transformers module lxt's default patch map holds.
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


def import_lxt() -> types.ModuleType:
    """``lxt.efficient``. It imports ``torchvision.models.vision_transformer`` for its ViT rules, and PyPI's
    torchvision cannot load beside CPU torch, so without torchvision it gets a stand-in module whose only
    attribute, ``nn``, is what lxt's ViT patch map reads (the ViT rules are never used here)."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        vit = types.ModuleType("torchvision.models.vision_transformer")
        vit.nn = torch.nn
        models = types.ModuleType("torchvision.models")
        models.vision_transformer = vit
        sys.modules.update({"torchvision": types.ModuleType("torchvision"), "torchvision.models": models,
                            "torchvision.models.vision_transformer": vit})  # fmt: skip
    return importlib.import_module("lxt.efficient")


def load(folder: Path) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """The model, patched by lxt for its family before it is built, float32, and its fast tokenizer."""
    config = legacy.config(folder)
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise NotImplementedError(f"lxt 2.1 has no efficient rules for {config.model_type}")
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    import_lxt().monkey_patch(modeling)
    model = legacy.model(folder, config)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model, legacy.tokenizer(folder)


def token_relevance(model: torch.nn.Module, ids: torch.Tensor, answer: list[int]) -> torch.Tensor:
    """lxt's relevance of each token for Σ_t logit(x_t) at rows t − 1: (embeddings × gradient).sum(-1)."""
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    rows = torch.tensor(answer) - 1
    logits = model(inputs_embeds=embeds, use_cache=False, logits_to_keep=rows).logits[0]
    logits.gather(-1, ids[0, answer, None]).sum().backward()
    return (embeds * embeds.grad).float().sum(-1)[0].detach()


def main(argv: list[str] | None = None) -> None:
    """Score every exported sample (one model folder per file)."""
    args = peer_io.arguments(argv=argv)
    torch.set_num_threads(args.threads)
    samples = list(peer_io.samples(args.exported))
    model, tokenizer = load(Path(samples[0]["model"]))

    def score(sample: dict) -> list[float]:
        if Path(sample["model"]) != Path(samples[0]["model"]):
            raise ValueError(f"one model per file: {sample['model']} after {samples[0]['model']}")
        ids, offsets, answer = peer_io.tokens(tokenizer, sample)
        ids = torch.tensor([ids])
        return peer_io.sum_by_source(token_relevance(model, ids, answer).tolist(), offsets, sample)

    peer_io.run(args, score)


if __name__ == "__main__":
    main()
