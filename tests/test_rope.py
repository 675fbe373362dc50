"""probe.rope_base against a model built from a config with the changed rope_theta (fp32, ≤ 1e-5)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import probe

ATOL = 1e-5
SEQ = 40  # several times the tiny Gemma's sliding window (6)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def rebuilt(model, factor, layer_types=("full_attention",)):
    """The reference: the same weights in a model built from a config with ``factor`` times the base."""
    config = copy.deepcopy(model.config)
    parameters = config.rope_parameters
    for params in [parameters] if "rope_theta" in parameters else [parameters[t] for t in layer_types]:
        params["rope_theta"] *= factor
    reference = AutoModelForCausalLM.from_config(config)
    reference.load_state_dict(model.state_dict())
    return reference.eval()


def random_ids(model):
    return torch.randint(0, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("factor", [0.01, 4.0])
def test_a_changed_base_equals_the_model_built_with_it(tiny, factor):
    ids, parameters = random_ids(tiny), copy.deepcopy(tiny.config.rope_parameters)
    before = logits(tiny, ids)
    with probe.rope_base(tiny, factor):
        changed = logits(tiny, ids)
    torch.testing.assert_close(changed, logits(rebuilt(tiny, factor), ids), atol=ATOL, rtol=0)
    assert (changed - before).abs().max() > 1e-3  # the change reaches the logits
    assert torch.equal(logits(tiny, ids), before) and tiny.config.rope_parameters == parameters


def test_gemma3_scales_the_global_base_by_default_and_both_on_request():
    model = probe.tiny_model("gemma3")
    ids, rotary = random_ids(model), model.model.rotary_emb
    local = rotary.sliding_attention_inv_freq
    with probe.rope_base(model, 0.1):
        assert rotary.sliding_attention_inv_freq is local  # the local layers keep their base
        global_only = logits(model, ids)
    both = ("full_attention", "sliding_attention")
    with probe.rope_base(model, 0.1, layer_types=both):
        scaled = logits(model, ids)
    torch.testing.assert_close(global_only, logits(rebuilt(model, 0.1), ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(scaled, logits(rebuilt(model, 0.1, both), ids), atol=ATOL, rtol=0)


def test_the_model_is_restored_after_an_exception(tiny):
    ids, rotary = random_ids(tiny), tiny.model.rotary_emb
    before, parameters = logits(tiny, ids), tiny.config.rope_parameters
    buffers = {name: buffer for name, buffer in rotary.named_buffers()}
    nested = logits(rebuilt(tiny, 1.5), ids)
    with pytest.raises(RuntimeError, match="inside"), probe.rope_base(tiny, 0.5):
        with probe.rope_base(tiny, 3.0):  # nested: the factors multiply
            torch.testing.assert_close(logits(tiny, ids), nested, atol=ATOL, rtol=0)
        raise RuntimeError("inside")
    assert tiny.config.rope_parameters is parameters
    assert all(buffer is buffers[name] for name, buffer in rotary.named_buffers())
    assert torch.equal(logits(tiny, ids), before)


@pytest.mark.parametrize(
    "factor, layer_types, message",
    [
        (0.0, ("full_attention",), "above 0"),
        (-1.0, ("full_attention",), "above 0"),
        (2.0, ("local",), "unknown"),
    ],
)
def test_bad_arguments_are_refused(factor, layer_types, message):
    model = probe.tiny_model("gemma3")
    with pytest.raises(ValueError, match=message), probe.rope_base(model, factor, layer_types):
        pass
