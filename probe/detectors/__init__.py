"""Critical-token detectors: one registry, one signature.

Every detector maps ``(model, tokenizer, sample, **options)`` to one score per token of the
sample (higher = more critical) and the set it would flag by its own rule, returned as a
:class:`Detection` that carries its settings. The answer rows are the rows that predict the
sample's teacher-forced gold answer (rows ``sample.target_positions − 1``); scores for tokens at
or after the answer are not meaningful for detection and :mod:`probe.metrics` ignores them.
A detector is named once, in ``@register(name)``, which also says whether it reads the shared
answer-attribution pass (``shared_pass=``); the registry stamps the name on its result. Adding a
detector is one decorated function in one module, named as it is registered (``random`` is
``random_scores``, not to shadow the standard module); :func:`detect` and :func:`attribute` take that
name as ``detector``.

    >>> detection = probe.detect("information_flow", model, tokenizer, sample)
    >>> detection.scores.shape, detection.flagged.sum()
    >>> probe.detectors.names()

The package, by concern: :mod:`~probe.detectors.registry` (:class:`Detection`, :func:`register`,
:func:`names`, :func:`options`; ``registry.resolve(name)`` gives the one record of a detector that every
step of a run uses, so that a name is looked up once), :mod:`~probe.detectors.one_pass` (the attention
and gradient detectors), :mod:`~probe.detectors.baselines` (``lsd``, ``random``, ``recency``,
``lexical_overlap``), :mod:`~probe.detectors.ablation` (``leave_one_out``, ``context_cite``) and
:mod:`~probe.detectors.run` (:func:`detect`, :func:`detect_many` and its shared pass,
:func:`attribute`). Every name is importable from ``probe.detectors`` itself.
"""

# isort: off
# The detectors register on import, in this order: the order names() gives (the CLI's choices and
# the tests rely on it). Keep it: one_pass, then baselines, then ablation.
from probe.detectors.registry import (
    PASS_OPTIONS,
    Detection,
    Detector,
    SharedPass,
    check_detection_of,
    names,
    option_default,
    options,
    register,
    replace,
    sandbox,
    shared_pass,
    spread_over_tokens,
    top_k_mask,
)
from probe.detectors.one_pass import (
    at2,
    attention,
    attn_lrp,
    embedding_grad,
    fr,
    grad_times_input,
    information_flow,
    integrated_gradients,
    key_removal_banzhaf,
    key_removal_grad,
)
from probe.detectors.baselines import lexical_overlap, lsd, random_scores, recency
from probe.detectors.ablation import context_cite, leave_one_out
from probe.detectors.run import (
    attribute,
    detect,
    detect_many,
    from_attribution,
)
# isort: on

__all__ = [
    "PASS_OPTIONS",
    "Detection",
    "Detector",
    "SharedPass",
    "at2",
    "attention",
    "attn_lrp",
    "attribute",
    "check_detection_of",
    "context_cite",
    "detect",
    "detect_many",
    "embedding_grad",
    "fr",
    "from_attribution",
    "grad_times_input",
    "information_flow",
    "integrated_gradients",
    "key_removal_banzhaf",
    "key_removal_grad",
    "leave_one_out",
    "lexical_overlap",
    "lsd",
    "names",
    "option_default",
    "options",
    "random_scores",
    "recency",
    "register",
    "shared_pass",
    "spread_over_tokens",
    "top_k_mask",
    "replace",
    "sandbox",
]
