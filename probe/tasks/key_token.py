"""``key-token``: explain a real essay token that depends on far context, nothing planted.

LongPPL (Fang et al., ICLR 2025, eqs. 2–4) calls a token *key* when the long context raises its
log-probability by more than α nats over a short context of the last K tokens (LSD > α) and the
model predicts it well with the long context (LCL > β). This task takes consecutive essay sentences
from a random place, scores them with :func:`probe.probes.lsd.lsd_scores` on the given model, picks one key
token at random among those within 5 % of ``length`` tokens (the next window of the essays if there is
none, up to 8 windows), and asks the most natural long-context
attribution question: which earlier sentences does this prediction depend on?

The sample is a plain continuation (no instruction, no chat template): every whole sentence before
the key token is one source (category ``context``), the start of its own sentence is the
``question`` (the local context, never removed), and the key token is the teacher-forced ``answer``
(its leading whitespace included, as the model reads it). ``options`` record the evaluator model, K,
d, α, β and the token's LSD and LCL.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from itertools import islice

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from probe.checks import model_context
from probe.errors import InvalidValueError
from probe.probes.lsd import key_token_mask, lsd_scores
from probe.tasks.noise import sentence_stream
from probe.tasks.sample import Prompt, Sample, Unit, render

WINDOW = 0.05  # the key token lies within this fraction of ``length`` tokens of position ``length``
ATTEMPTS = 32  # essay windows searched one after the other (a sample found earlier is unchanged)


def key_token(
    tokenizer: PreTrainedTokenizerBase,
    settings: dict,
    rng: np.random.Generator,
    model=None,
    K: int | None = None,
    d: int | None = None,
    alpha: float = 2.0,
    beta: float = -2.0,
    chat: bool | None = None,
) -> Sample:
    """A key token near position ``length`` of an essay, scored by ``model`` (module docstring).

    ``K``: the short context of LSD (default ``length // 8``, LongPPL's 4K of 32K); ``d``: the stride
    of its sliding windows (default ``K``); ``alpha``, ``beta``: the thresholds of eq. 4.
    """
    length = settings["length"]
    K = max(16, length // 8) if K is None else int(K)
    d = K if d is None else int(d)
    if model is None:
        raise InvalidValueError(
            "the key-token task finds its token with probe.probes.lsd on a model: "
            "tasks.make('key-token', tokenizer, length, seed, model=model)"
        )
    if chat:
        raise InvalidValueError("key-token is a plain continuation of essay text: it takes no chat template")
    if settings["depth"] is not None:
        raise InvalidValueError("key-token takes no depth: the key token is wherever the essay puts one")
    context = model_context(model) or math.inf  # the sample, up to the key token, fits the model
    lo, hi = max(K + 1, int(length * (1 - WINDOW))), int(min(length * (1 + WINDOW) + 1, context))
    if lo >= hi:
        raise InvalidValueError(f"length {length} leaves no position beyond the short context K = {K}")
    positions = torch.arange(lo, hi)
    name = getattr(getattr(model, "config", None), "name_or_path", None) or type(model).__name__
    options = {"model": name, "K": K, "d": d, "alpha": alpha, "beta": beta}
    stream = sentence_stream(rng)
    for _ in range(ATTEMPTS):
        sentences, text, ids, offsets = _essay_window(tokenizer, stream, hi)
        ids = ids[: min(len(ids), context)]  # LSD reads no further than the model can
        lsd, lcl = lsd_scores(model, ids, K=K, d=d, target_positions=positions.tolist())
        key = key_token_mask(lsd, lcl, alpha, beta)
        starts = np.cumsum([0] + [len(s) + 1 for s in sentences])  # each sentence's first character
        candidates = []  # (position, its sentence, its first visible character, its end)
        for t in positions[key[positions].cpu()].tolist():
            first, end = (int(x) for x in offsets[t])
            visible = end - len(text[first:end].lstrip())
            sentence = int(np.searchsorted(starts, visible, side="right")) - 1
            if starts[sentence] < visible < end:  # a visible token, not the first of its sentence
                candidates.append((t, sentence, visible, end))
        for index in rng.permutation(len(candidates)).tolist():
            t, sentence, visible, end = candidates[index]
            before = text[starts[sentence] : visible]  # the token's sentence up to it, and its whitespace
            prompt = Prompt(
                instruction="",
                question=before.rstrip(),
                answer=text[visible:end],
                answer_prefix="",
                answer_pattern=re.escape(text[visible:end]),
                separator=" ",
                question_open=" " if sentence else "",
                answer_open="",
                answer_separator=before[len(before.rstrip()) :],
            )
            body = [Unit(s, "context") for s in sentences[:sentence]]
            scored = options | {"lsd": float(lsd[t]), "lcl": float(lcl[t])}
            sample = render(tokenizer, prompt, body, settings | {"options": scored}, chat=False)
            if torch.equal(sample.input_ids, ids[: t + 1]):  # the text up to it tokenizes as in the essay
                return sample
    raise InvalidValueError(
        f"no key token (LSD > {alpha}, LCL > {beta}, K = {K}) within {WINDOW:.0%} of position {length} in "
        f"{ATTEMPTS} essay windows; try another seed, or a lower alpha or beta"
    )


def _essay_window(tokenizer: PreTrainedTokenizerBase, stream: Iterator[str], tokens: int):
    """The next consecutive essay sentences of ``stream``, joined by spaces, holding at least ``tokens``
    tokens: (sentences, text, input_ids LongTensor[n], offsets int64 [n, 2]), tokenized once with the
    tokenizer's special tokens."""
    sentences: list[str] = []
    while True:
        more = list(islice(stream, max(8, tokens // 40)))
        if not more:
            raise InvalidValueError(f"the essays hold too little text for a window of {tokens} tokens")
        sentences += more
        text = " ".join(sentences)
        encoding = tokenizer(text, return_offsets_mapping=True)
        if len(encoding["input_ids"]) >= tokens:
            offsets = np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2)
            return sentences, text, torch.tensor(encoding["input_ids"]), offsets
