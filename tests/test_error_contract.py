"""The error contract of :mod:`probe.errors`, proven by fuzzing every public callable.

Every callable of ``probe.__all__``, every detector of the registry and every task is called with one
argument replaced by a malformed value that Hypothesis draws (wrong types, empty, negative,
fractional, NaN, huge, other shapes); the call must return a result or raise a
:class:`probe.LongprobeError` — never a raw error from torch, numpy, pandas, transformers or Python.
A new public callable fails :func:`test_every_public_callable_has_a_valid_call` until it has an
entry in :func:`valid_calls`, so it is fuzzed the day it is added. ``LONGPROBE_FUZZ_EXAMPLES``
(default 6) sets the examples per argument.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import probe
from probe import detectors, tasks
from probe.models import converted_folder
from probe.target import AnswerToken, Contrast

EXAMPLES = int(os.environ.get("LONGPROBE_FUZZ_EXAMPLES", 6))
NOT_CALLED = {"detectors", "errors", "metrics", "LongprobeError", "UnsupportedModelError",
              "ActivationCache", "RetrievalScores", "Detection", "Sample"}  # fmt: skip


@functools.cache
def context() -> dict:
    tokenizer = AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))
    model = probe.tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=1024)
    sample = tasks.make("multihop-1", tokenizer, 160, seed=0)
    with probe.record_heads(model) as cache:
        model(sample.input_ids[None])
    return {"model": model, "tokenizer": tokenizer, "sample": sample, "ids": sample.input_ids,
            "targets": sample.target_positions, "cache": cache,
            "longppl": probe.longppl("Mary went home. " * 20, model, tokenizer, K=8, d=8)}  # fmt: skip


def forward(c: dict) -> None:
    with torch.no_grad():
        c["model"](c["ids"][None])


def valid_calls(c: dict) -> dict[str, tuple[Callable, dict]]:
    """Public name -> (callable, valid keyword arguments); a context manager is entered, runs a forward."""
    m, tok, s, ids, t = c["model"], c["tokenizer"], c["sample"], c["ids"], c["targets"]
    text = "Mary went home. " * 20
    return {
        "detect": (probe.detect, dict(detector="attention", model=m, tokenizer=tok, sample=s)),
        "ablate_heads": (probe.ablate_heads, dict(model=m, heads=[(0, 1)])),
        "answer": (probe.answer, dict(model=m, tokenizer=tok, sample=s, max_new_tokens=2)),
        "answer_attribution": (probe.answer_attribution, dict(model=m, input_ids=ids, target_positions=t)),
        "attention_window": (probe.attention_window, dict(model=m, window=16)),
        "attention_matrices": (probe.attention_matrices, dict(model=m, input_ids=ids[:40], layers=[0])),
        "attention_rows": (probe.attention_rows, dict(model=m, input_ids=ids, rows=t)),
        "attribute": (probe.attribute, dict(model=m, tokenizer=tok, context="Mary went home. Tom left.",
                                            query="Where?", response="home", detector="attention")),
        "checkpointed": (probe.checkpointed, dict(model=m, enabled=True)),
        "context_selector": (probe.context_selector, dict(model=m, input_ids=ids[:40])),
        "embedding_grad_norms": (probe.embedding_grad_norms, dict(model=m, input_ids=ids,
                                                                  target_positions=t)),
        "embedding_grads": (probe.embedding_grads, dict(model=m, input_ids=ids, target_positions=t)),
        "information_flow": (probe.information_flow, dict(model=m, input_ids=ids, target_positions=t)),
        "load_model": (probe.load_model, dict(spec=m)),
        "longppl": (probe.longppl, dict(text=text, model=m, tokenizer=tok, K=8, d=8)),
        "mask_keys": (probe.mask_keys, dict(model=m, positions=[1, 2])),
        "noise_restraint": (probe.noise_restraint, dict(model=m, sample=s, lr=0.01)),
        "patch_heads": (probe.patch_heads, dict(model=m, source_cache=c["cache"], heads=[(0, 1)])),
        "plan": (probe.plan, dict(model=m, seq_len=512)),
        "pool_longppl": (probe.pool_longppl, dict(results=[c["longppl"]])),
        "record_heads": (probe.record_heads, dict(model=m, layers=[0])),
        "retrieval_scores": (probe.retrieval_scores, dict(model=m, tokenizer=tok, samples=[s],
                                                          require_correct=False)),
        "rope_base": (probe.rope_base, dict(model=m, factor=2.0)),
        "target_loss": (probe.target_loss, dict(model=m, input_ids=ids[None], target_positions=t)),
        "tiny_model": (probe.tiny_model, dict(arch="llama", vocab_size=64)),
        "to_bridge": (probe.to_bridge, dict(model=m, tokenizer=tok)),
        "token_lsd": (probe.token_lsd, dict(model=m, tokenizer=tok, text=text, K=8, d=8)),
        "trace": (probe.trace, dict(model=m, rows=[5], layers=[0])),
        "tasks.make": (tasks.make, dict(task="multihop-1", tokenizer=tok, length=160, seed=0)),
        "Sample.from_text": (probe.Sample.from_text, dict(tokenizer=tok, context="Mary left.",
                                                          query="Who left?", response="Mary")),
        "Sample.with_answer": (s.with_answer, dict(answer="Mary went home", tokenizer=tok)),
        "given_answer": (probe.given_answer, dict(sample=s, reply="Mary went home.")),
        "metrics.source_plausibility": (probe.metrics.source_plausibility,
                                        dict(scores=[0.5] * len(s.sources), sample=s)),
        # the constructors of the public classes, fuzzed as the functions are
        "Contrast": (Contrast, dict(foil=[1, 2])),
        "AnswerToken": (AnswerToken, dict(index=0)),
    }  # fmt: skip


VALID_CALLS = sorted(valid_calls(context()))
SLOW = {"to_bridge", "longppl", "pool_longppl", "token_lsd", "noise_restraint", "retrieval_scores",
        "attribute"}  # fmt: skip

ODD = [object(), {"a": 1}, torch.zeros(2, 3), torch.tensor([1.5]), torch.tensor([], dtype=torch.long),
       torch.tensor([[1, 2], [3, 4]]), "🌙", (), [(0,)], [(0, 1, 2)],
       math.nan, math.inf, -math.inf]  # fmt: skip
BAD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.integers(-5, 300), max_size=4),
    st.lists(st.lists(st.integers(-5, 300), max_size=3), max_size=3),
    st.lists(st.floats(-2, 2), min_size=1, max_size=3),
    st.sampled_from(ODD),
)


def call(name: str, arguments: dict):
    """Run one call; a context manager is entered and runs one forward."""
    function, _ = valid_calls(context())[name]
    result = function(**arguments)
    if isinstance(result, contextlib.AbstractContextManager):
        with result:
            forward(context())
    return result


def test_every_public_callable_has_a_valid_call():
    public = {name for name in probe.__all__ if name not in NOT_CALLED}
    assert public <= set(VALID_CALLS), f"add a valid call for {sorted(public - set(VALID_CALLS))}"


@pytest.mark.parametrize("name", VALID_CALLS)
def test_the_valid_calls_are_valid(name):
    call(name, valid_calls(context())[name][1])


def fuzz_cases() -> list[tuple[str, str]]:
    cases = []
    for name, (function, arguments) in sorted(valid_calls(context()).items()):
        cases += [(name, arg) for arg in inspect.signature(function).parameters if arg in arguments]
    return cases


def assert_within_the_contract(run: Callable[[], object], what: str, must_refuse: bool = False) -> None:
    try:
        run()
    except probe.LongprobeError:
        return
    except (KeyboardInterrupt, torch.OutOfMemoryError):
        raise
    except Exception as error:  # noqa: BLE001 - the point: nothing else may escape
        raise AssertionError(f"{what} raised a raw {type(error).__name__}: {error}") from error
    assert not must_refuse, f"{what} returned a result for a value its annotation rules out"


def ruled_out(function: Callable, argument: str, value) -> bool:
    """A value a numeric parameter (annotated ``int`` / ``float``, maybe ``| None``) can never take:
    text, NaN, a list."""
    annotation = str(inspect.signature(function).parameters[argument].annotation)
    numeric = {kind.strip() for kind in annotation.split("|")} <= {"int", "float", "None"}
    nan = isinstance(value, float) and math.isnan(value)
    return numeric and (isinstance(value, (str, list)) or nan)


@pytest.mark.parametrize("name, argument", fuzz_cases())
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(value=BAD_VALUES)
def test_a_malformed_argument_gets_a_longprobe_error_or_a_result(name, argument, value):
    if name in SLOW and EXAMPLES < 20:
        value = value if isinstance(value, str | type(None)) else None  # a few cheap examples suffice
    function, valid = valid_calls(context())[name]
    arguments = valid | {argument: value}
    refuse = ruled_out(function, argument, value)
    assert_within_the_contract(lambda: call(name, arguments), f"{name}({argument}={value!r})", refuse)


@pytest.mark.parametrize("detector", detectors.names())
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(option=st.data(), value=BAD_VALUES)
def test_every_detector_option_gets_a_longprobe_error_or_a_result(detector, option, value):
    names = sorted(detectors.options(detector))
    if not names:
        return
    chosen = option.draw(st.sampled_from(names))
    c = context()
    assert_within_the_contract(
        lambda: probe.detect(detector, c["model"], c["tokenizer"], c["sample"], **{chosen: value}),
        f"detect({detector!r}, {chosen}={value!r})",
        ruled_out(detectors.registry.lookup(detector), chosen, value),
    )


def test_the_silent_and_misleading_cases_are_refused_with_what_to_do():
    c = context()
    model, tokenizer, sample = c["model"], c["tokenizer"], c["sample"]
    answer = sample.input_ids[sample.target_positions]
    with pytest.raises(probe.errors.InvalidValueError, match="foil is the answer itself"):
        probe.detect("information_flow", model, tokenizer, sample, target=Contrast(answer))
    prompt_only = probe.Sample.from_text(tokenizer, "Mary went home.", "Where is Mary?")
    with pytest.raises(probe.errors.InvalidValueError, match="no answer to explain"):
        probe.detect("leave_one_out", model, tokenizer, prompt_only)
    found = probe.detect("recency", model, tokenizer, sample)
    with pytest.raises(probe.errors.InvalidValueError, match="pass the sample it was made for"):
        found.to_frame(tokenizer, prompt_only)
    with pytest.raises(probe.errors.InvalidValueError, match="not available here"):
        probe.load_model("smollm2-135m", device="nowhere:0")


@pytest.mark.parametrize(
    "kind, record",
    [("RetrievalScores", {"scores": 3, "trials": 5, "settings": {}, "argmax": []}),
     ("Detection", {"scores": "x", "flagged": [1], "settings": {}, "details": []}),
     ("HeadWeights", {"weights": {"a": 1}, "settings": 2})],
)  # fmt: skip
def test_a_result_file_with_a_malformed_field_names_the_file(tmp_path, kind, record):
    import json

    from probe.probes.at2 import HeadWeights

    path = tmp_path / "result.json"
    path.write_text(json.dumps(record))
    load = {"RetrievalScores": probe.RetrievalScores, "Detection": probe.Detection,
            "HeadWeights": HeadWeights}  # fmt: skip
    with pytest.raises(probe.errors.InvalidValueError, match=f"not a valid {kind} file"):
        load[kind].load(path)


def test_a_bare_position_says_to_pass_a_list():
    model = probe.tiny_model("llama")
    with pytest.raises(probe.errors.InvalidTypeError, match=r"pass \[10\]"):
        probe.information_flow(model, torch.arange(20), 10)
