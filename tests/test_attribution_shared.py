"""The attention family's shared pass: one forward+backward equals the separate passes."""

import pytest
import torch
from reference import eager_forward, head_weights_for
from transformers import AutoTokenizer

import probe
from probe import detectors, tasks
from probe.models import converted_folder
from probe.probes.attribution import answer_attribution, attention_rows, embedding_grads, information_flow

TOL = 1e-6  # fp32, absolute and relative: the shared pass and the separate passes run the same operations
CHEAP = {  # the expensive detectors at settings that keep the test fast (same settings on both sides)
    "integrated_gradients": {"n_steps": 2, "internal_batch_size": 2},
    "lsd": {"K": 64, "d": 32},
    "context_cite": {"n_masks": 8},
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def story(request, tokenizer):
    """A tiny random model over the SmolLM2 vocabulary and a real 2-hop sample of 256 tokens."""
    model = probe.tiny_model(request.param, vocab_size=len(tokenizer))
    return model, tasks.make("multihop-2", tokenizer, 256, seed=3)


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """|got − expected| ≤ TOL + TOL·|expected| elementwise (a norm of 27 differs in its 8th digit)."""
    torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL, equal_nan=True)


@pytest.mark.parametrize("layers", [None, [-1, 0]])
def test_answer_attribution_equals_the_separate_passes(story, layers):
    model, sample = story
    ids, targets = sample.input_ids, sample.target_positions
    shared = answer_attribution(model, ids, targets, layers)
    chosen = probe.checks.check_layers(model, layers)
    assert shared.layers == tuple(chosen) and torch.equal(shared.rows, targets - 1)
    assert_close(shared.pattern, attention_rows(model, ids, targets - 1, layers))
    assert_close(shared.embedding_grad, embedding_grads(model, ids, targets))
    for reduce in ("sum_then_abs", "abs_then_sum"):
        expected = information_flow(model, ids, targets, layers, reduce)
        assert_close(shared.information_flow(chosen, reduce), expected)
    assert_close(shared.embedding_grad_norms(p=1), probe.embedding_grad_norms(model, ids, targets, p=1))
    assert all(p.grad is None and p.requires_grad for p in model.parameters())  # restored, no gradients


def test_select_picks_layers_in_the_order_asked_and_refuses_missing_ones(story):
    model, sample = story
    shared = answer_attribution(model, sample.input_ids, sample.target_positions, [0, 2])
    pattern, grad = shared.select([2, 0])
    assert torch.equal(pattern, shared.pattern.flip(0)) and torch.equal(grad, shared.pattern_grad.flip(0))
    with pytest.raises(ValueError, match="not captured"):
        shared.select([1])


def assert_same_detection(got: detectors.Detection, expected: detectors.Detection) -> None:
    assert got.name == expected.name and got.settings == expected.settings
    assert_close(got.scores, expected.scores)
    assert torch.equal(got.flagged, expected.flagged)
    assert got.details.keys() == expected.details.keys()
    for key, value in expected.details.items():
        if torch.is_tensor(value):
            assert_close(got.details[key], value)
        elif isinstance(value, str):  # e.g. the detector that scored the unmeasured sources
            assert got.details[key] == value
        else:
            assert got.details[key] == pytest.approx(value, rel=TOL, abs=TOL, nan_ok=True)


def test_detect_many_equals_detect_one_by_one_for_every_detector(story, tokenizer):
    model, sample = story
    names = detectors.names()
    options = {**CHEAP, "at2": {"weights": head_weights_for(model)}}
    found = detectors.detect_many(names, model, tokenizer, sample, options)
    assert list(found) == names
    for name in names:
        expected = probe.detect(name, model, tokenizer, sample, **options.get(name, {}))
        assert_same_detection(found[name], expected)


def test_detect_many_shares_one_pass_over_the_union_of_layers(story, tokenizer, monkeypatch):
    model, sample = story
    options = {
        "attention": {"layers": [0], "top_k": 5},
        "fr": {"layers": [-1, 0]},
        "information_flow": {"reduce": "abs_then_sum"},
        "embedding_grad": {"p": 1},
    }
    expected = {name: probe.detect(name, model, tokenizer, sample, **options[name]) for name in options}
    passes = []

    def counted(*args, **kwargs):
        passes.append(args[3])
        return answer_attribution(*args, **kwargs)

    for module in (detectors.registry,):  # the one shared pass, alone or in detect_many
        monkeypatch.setattr(module, "answer_attribution", counted)
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        found = detectors.detect_many(list(options), model, tokenizer, sample, options)
    finally:
        hook.remove()
    n_layers = model.config.num_hidden_layers
    assert passes == [list(range(n_layers))]  # the union of the layers asked
    assert len(forwards) == 1  # one forward (and its backward) for all four
    for name in options:
        assert_same_detection(found[name], expected[name])


def test_detect_many_reads_the_embedding_gradient_off_one_pass_and_refuses_bad_names(story, tokenizer):
    model, sample = story
    found = detectors.detect_many(["embedding_grad", "grad_times_input", "recency"], model, tokenizer, sample)
    assert_same_detection(found["embedding_grad"], probe.detect("embedding_grad", model, tokenizer, sample))
    grads = embedding_grads(model, sample.input_ids, sample.target_positions)
    assert torch.allclose(found["embedding_grad"].scores, grads.norm(dim=-1), atol=1e-6)
    with pytest.raises(ValueError, match="unknown detector"):
        detectors.detect_many(["attention", "nope"], model, tokenizer, sample)
    with pytest.raises(ValueError, match="unknown detector"):
        detectors.detect_many(["attention"], model, tokenizer, sample, {"atention": {"top_k": 3}})
    with pytest.raises(TypeError):
        detectors.detect_many(["attention"], model, tokenizer, sample, {"attention": {"p": 3}})


def test_a_new_shared_pass_detector_is_one_decorated_reader(story, tokenizer, sandbox):
    """``@register(name, shared_pass=...)`` on a reader of the attribution is the whole detector: alone it
    runs its pass (forward only when it reads no gradient), in detect_many it shares the pass, and its
    options, the pass's ``target`` and ``checkpoint`` included, are checked like any detector's."""
    model, sample = story

    @detectors.register("last_layer_grad", shared_pass=detectors.SharedPass(layers="all"))
    def last_layer_grad(model, attribution, sample, top_k: int = 3):
        """|∂L/∂A| of the last layer's answer rows, summed over heads and rows."""
        scores = attribution.pattern_grad[-1].abs().sum(dim=(0, 1))
        return detectors.Detection(scores, detectors.top_k_mask(scores, top_k, sample.prompt_length), {})

    assert detectors.options("last_layer_grad") == ["top_k", "checkpoint", "target"]
    alone = probe.detect("last_layer_grad", model, tokenizer, sample)
    attentions, loss = eager_forward(model, sample.input_ids[None], sample.target_positions)
    loss.backward()
    slow = attentions[-1].grad[0][:, sample.target_positions - 1].abs().sum(dim=(0, 1))
    assert torch.allclose(alone.scores, slow, atol=1e-7, rtol=1e-4)
    found = detectors.detect_many(["attention", "last_layer_grad"], model, tokenizer, sample)
    assert_same_detection(found["last_layer_grad"], alone)
    with pytest.raises(TypeError, match="takes no option"):
        probe.detect("last_layer_grad", model, tokenizer, sample, layers=[0])
    with pytest.raises(TypeError, match=r"\(model, attribution, sample, \*\*options\)"):
        detectors.register("wrong", shared_pass=detectors.SharedPass())(lambda model, tokenizer, sample: None)
