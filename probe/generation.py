"""Greedy answering: the one way every analysis, notebook and probe lets a model answer a sample."""

from __future__ import annotations

import re

import torch

from probe.checks import check_int, check_sample_fits, check_tokenizer, hf_model, input_device
from probe.errors import InvalidTypeError
from probe.tasks import Sample, check_sample

#: New tokens of a reply to a real question (RULER's ``tokens_to_generate`` for QA); the reply ends
#: earlier at the model's end of turn.
REPLY_TOKENS = 32


def answer(model, tokenizer, sample: Sample, max_new_tokens: int | None = None) -> str:
    """The model's greedy continuation of ``sample``'s prompt, decoded and stripped; it stops at the
    model's end of turn (its ``eos_token_id``).

    At most ``max_new_tokens`` new tokens (default: the gold answer's token count + 4 for a task with
    candidate answers, :data:`REPLY_TOKENS` for a real question, ``sample.scoring == "exact_match"``).
    """
    inner = hf_model(model)
    check_tokenizer(tokenizer)
    check_sample(sample)
    if max_new_tokens is not None:
        check_int(max_new_tokens, "max_new_tokens", 1)
    elif sample.scoring == "exact_match":
        max_new_tokens = REPLY_TOKENS
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


def given_answer(sample: Sample, reply: str) -> str:
    """The answer ``reply`` gives to ``sample``'s question: for a task with candidate answers
    (``scoring == "pattern"``) the first candidate it names, as :meth:`Sample.score` reads it; otherwise,
    and where it names none, its first non-empty line (a completion model goes on past its answer with
    more text; a chat model's reply ends at its end of turn). ``""`` for an empty reply."""
    check_sample(sample)
    if not isinstance(reply, str):
        raise InvalidTypeError(f"reply must be the text a model generated, got {reply!r:.60}")
    if sample.scoring == "pattern":
        found = re.search(sample.answer_pattern, reply, flags=re.IGNORECASE)
        if found is not None:
            return found.group(0)
    return next((line.strip() for line in reply.splitlines() if line.strip()), "")
