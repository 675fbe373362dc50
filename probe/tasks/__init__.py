"""Synthetic long-context tasks with exact token-level ground truth.

``make(task, tokenizer, length, seed, depth, **options)`` builds one :class:`Sample` for a tokenizer:
the prompt (chat template applied when the tokenizer has one, else a completion prompt ending in
``Answer: <answer prefix>``) followed by the gold answer, with token spans per category
(``supporting``, ``interference``, ``noise``, ``low_frequency``, ``question``, ``answer``), token
offsets, ``target_positions``, ``categories`` and ``sources`` (its ablation units, :class:`Source`).
``names()`` lists the text tasks. The vector-valued in-context classification task of the
position-bias study lives in :mod:`probe.tasks.classification`.

Common options: ``chat`` (force the chat template on/off). Task options: ``digits`` (passkey),
``distractors`` (niah), ``needles`` (multivalue-niah), ``lines`` (lines: ``n`` lines in essay noise
instead of a full record), ``emojis`` (multihop-*), ``model`` (key-token: the model whose LSD picks the
token; also ``K``, ``d``, ``alpha``, ``beta``).

``document-1`` … ``document-3`` plant a chain of plain sentences in essay text (:mod:`probe.tasks.document`);
``key-token`` plants nothing: a real essay token that depends on far context
(:mod:`probe.tasks.key_token`). ``hotpotqa`` is a real question with its gold supporting sentences
(:mod:`probe.tasks.hotpotqa`; option ``type``: ``"bridge"`` or ``"comparison"``), at its natural length
with ``length=None``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
from transformers import PreTrainedTokenizerBase

from probe.checks import check_int, check_tokenizer, model_context
from probe.errors import InvalidValueError
from probe.tasks.document import document
from probe.tasks.haystack import Depth
from probe.tasks.hotpotqa import hotpotqa_sample
from probe.tasks.key_token import key_token
from probe.tasks.kv import kv
from probe.tasks.lines import lines
from probe.tasks.needle import multivalue_niah, niah, passkey
from probe.tasks.sample import CATEGORIES, CONTEXT_CATEGORIES, Prompt, Sample, Source, Unit, check_sample
from probe.tasks.story import story

TASKS: dict[str, Callable[..., Sample]] = {
    **{f"multihop-{hops}": functools.partial(story, hops=hops) for hops in (1, 2, 3, 4)},
    "lines": lines,
    "passkey": passkey,
    "niah": niah,
    "multivalue-niah": multivalue_niah,
    "kv": kv,
    **{f"document-{hops}": functools.partial(document, hops=hops) for hops in (1, 2, 3)},
    "key-token": key_token,
    "hotpotqa": hotpotqa_sample,
}


def names() -> list[str]:
    """Names of the text tasks ``make`` builds."""
    return list(TASKS)


#: The tasks with a natural length (``make(..., length=None)``): real text that is not cut to a length.
NATURAL_LENGTH = ("hotpotqa",)
#: The tasks that score their text with a model (``make(..., model=...)``); the others ignore it.
SCORED_BY_MODEL = ("key-token",)

#: The multi-hop stories the one-pass detectors were developed on.
DEVELOPMENT_TASKS = ("multihop-1", "multihop-2", "multihop-3")
#: The held-out study's tasks (``figures/studies/heldout_protocol.md``): no detector was tuned on them.
HELD_OUT_TASKS = ("multihop-4", "kv", "document-2", "key-token")


def make(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    length: int | None,
    seed: int = 0,
    depth: Depth = None,
    model=None,
    **options,
) -> Sample:
    """One sample of ``task`` with a prompt of ``length`` tokens (± a few percent) for ``tokenizer``;
    ``None``: the task's natural length (the tasks of :data:`NATURAL_LENGTH`, whose ``length`` is a
    least: a shorter one gives the natural sample).

    ``depth`` places the supporting items: a number in [0, 1] (fraction of the filler text before
    them; all supporting facts at that depth, in order), one number per supporting item, or ``None``
    (uniform random, sorted). Deterministic in ``seed``. ``model``: the model the sample is for. The
    tasks of :data:`SCORED_BY_MODEL` score their text with it; every task keeps the whole sample,
    prompt and answer, within its context (:func:`probe.checks.model_context`): at a ``length`` near
    the context, the prompt comes out the few tokens shorter that the answer needs. See the module
    docstring for ``options``.
    """
    if not isinstance(task, str) or task not in TASKS:
        raise InvalidValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    if length is None and task not in NATURAL_LENGTH:
        raise InvalidValueError(
            f"task {task!r} has no natural length: give a length in tokens "
            f"(None is for {', '.join(NATURAL_LENGTH)})"
        )
    if length is not None and (
        not isinstance(length, int | np.integer) or isinstance(length, bool) or length <= 0
    ):
        raise InvalidValueError(f"length must be a positive number of tokens, got {length!r}")
    check_int(seed, "seed", 0)
    check_tokenizer(tokenizer)
    depth = depth if depth is None or np.isscalar(depth) else tuple(depth)
    context = None if model is None else model_context(model)
    if context is not None and length is not None and length > context:
        raise InvalidValueError(
            f"length {length} is longer than the model's context of {context} tokens; "
            f"ask for at most {context}"
        )
    length = None if length is None else int(length)
    settings = dict(task=task, length=length, seed=seed, depth=depth, options=options)
    if task in SCORED_BY_MODEL:
        options = {"model": model, **options}

    def built(target: int | None) -> Sample:
        return TASKS[task](tokenizer, settings | {"length": target}, np.random.default_rng(seed), **options)

    sample, target = built(length), length
    while context is not None and len(sample.input_ids) > context:  # the answer runs past the context
        if task in NATURAL_LENGTH and (target is None or sample.prompt_length < target):
            raise InvalidValueError(
                f"{task} seed {seed} needs {len(sample.input_ids)} tokens at its natural length, more than "
                f"the model's context of {context}"
            )
        target = (target or sample.prompt_length) - (len(sample.input_ids) - context)
        sample = dataclasses.replace(built(target), length=length)  # made by these settings
    return sample


__all__ = [
    "NATURAL_LENGTH",
    "CATEGORIES",
    "CONTEXT_CATEGORIES",
    "check_sample",
    "Prompt",
    "Sample",
    "Source",
    "TASKS",
    "Unit",
    "make",
    "names",
]
