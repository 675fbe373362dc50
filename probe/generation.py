"""Greedy answering: the one way every analysis, notebook and probe lets a model answer a sample."""

from __future__ import annotations

import torch

from probe.checks import check_int, check_sample, check_sample_fits, check_tokenizer, hf_model, input_device
from probe.tasks import Sample


def answer(model, tokenizer, sample: Sample, max_new_tokens: int | None = None) -> str:
    """The model's greedy continuation of ``sample``'s prompt, decoded and stripped.

    At most ``max_new_tokens`` new tokens (default: the gold answer's token count + 4).
    """
    inner = hf_model(model)
    check_tokenizer(tokenizer)
    check_sample(sample)
    if max_new_tokens is not None:
        check_int(max_new_tokens, "max_new_tokens", 1)
    check_sample_fits(inner, sample, tokenizer)
    prompt = sample.prompt_ids[None].to(input_device(inner))
    with torch.inference_mode():
        generated = inner.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=len(sample.target_positions) + 4 if max_new_tokens is None else max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id,
        )
    return tokenizer.decode(generated[0, prompt.shape[1] :], skip_special_tokens=True).strip()
