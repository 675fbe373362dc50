"""The four attention modifiers of the capture core, alone and nested in any order, against eager
attention with explicit masks built by Python loops (fp32, ≤ 1e-5)."""

import itertools
from contextlib import ExitStack

import pytest
import torch
from reference import masked_eager_forward

import probe
from probe.checks import UnsupportedModelError

ATOL = 1e-5
SEQ = 24  # longer than the tiny Gemma's sliding window (6)
HIDDEN = [2, 5, 9, 10]
WINDOW = 8
HEADS = [(1, 0), (0, 1)]


def random_ids(model, seq=SEQ, seed=0, batch=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator)


def modifiers(model):
    """Each modifier as a factory of its context manager."""
    return {
        "trace": lambda: probe.trace(model),
        "mask_keys": lambda: probe.mask_keys(model, HIDDEN),
        "attention_window": lambda: probe.attention_window(model, WINDOW),
        "ablate_heads": lambda: probe.ablate_heads(model, HEADS),
    }


def test_nested_modifiers_match_eager_in_every_order(tiny):
    ids = random_ids(tiny)
    attentions, logits = masked_eager_forward(tiny, ids, hidden=HIDDEN, window=WINDOW, heads=HEADS)
    factories = modifiers(tiny)
    for order in itertools.permutations(factories):
        with torch.no_grad(), ExitStack() as stack:
            entered = {name: stack.enter_context(factories[name]()) for name in order}
            got = tiny(input_ids=ids, use_cache=False).logits
        cache = entered["trace"]
        assert (got - logits).abs().max() <= ATOL, order
        for layer, attention in enumerate(attentions):
            assert (cache["pattern", layer][0] - attention[0]).abs().max() <= ATOL, (order, layer)
        assert tiny.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", ["mask_keys", "attention_window", "ablate_heads"])
def test_each_modifier_alone_matches_eager(tiny, name):
    ids = random_ids(tiny)
    settings = {
        "mask_keys": dict(hidden=HIDDEN),
        "attention_window": dict(window=WINDOW),
        "ablate_heads": dict(heads=HEADS),
    }[name]
    attentions, logits = masked_eager_forward(tiny, ids, **settings)
    with torch.no_grad(), modifiers(tiny)[name](), probe.trace(tiny, rows=[SEQ - 1]) as cache:
        got = tiny(input_ids=ids, use_cache=False).logits
    assert (got - logits).abs().max() <= ATOL
    assert (cache.stack() - torch.stack([a[0][:, [-1]] for a in attentions])).abs().max() <= ATOL
    _, unmodified = masked_eager_forward(tiny, ids)
    assert (unmodified - logits).abs().max() > 1e-3  # the modifier changes the output


def test_information_flow_under_a_key_mask_and_window_matches_retain_grad(tiny):
    ids = random_ids(tiny)
    targets = torch.tensor([11, 17, SEQ - 1])
    attentions, logits = masked_eager_forward(tiny, ids, hidden=HIDDEN, window=WINDOW)
    for attention in attentions:
        attention.retain_grad()
    torch.nn.functional.cross_entropy(logits[0, targets - 1], ids[0, targets]).backward()
    tiny.zero_grad(set_to_none=True)
    expected = torch.stack([(a * a.grad)[0][:, targets - 1].sum(0).abs().sum(0) for a in attentions])
    with probe.mask_keys(tiny, HIDDEN), probe.attention_window(tiny, WINDOW):
        got = probe.information_flow(tiny, ids, targets)
    assert expected.abs().max() > 1e-3
    assert (got - expected).abs().max() <= ATOL
    others = [h for h in HIDDEN if h not in targets - 1]  # a hidden row still sees its own key
    assert got[:, others].abs().max() <= ATOL  # hidden keys carry no information


def test_generation_under_a_key_mask_is_greedy_on_masked_logits(tiny):
    prompt = random_ids(tiny, seq=16)
    hidden = [1, 3, 4, 12]
    with probe.mask_keys(tiny, hidden):
        generated = tiny.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    ids = prompt
    for _ in range(6):  # no KV cache: the whole sequence again under the explicit mask
        _, logits = masked_eager_forward(tiny, ids, hidden=hidden)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, ids)
    assert tiny.config._attn_implementation == "sdpa"


def test_one_key_mask_per_sequence_of_a_batch(tiny):
    ids = random_ids(tiny, batch=2)
    hidden = torch.zeros(2, SEQ, dtype=torch.bool)
    hidden[0, [2, 5]] = True
    hidden[1, [7, 8, 20]] = True
    with torch.no_grad(), probe.mask_keys(tiny, hidden):
        batched = tiny(input_ids=ids, use_cache=False).logits
    for row in range(2):
        positions = hidden[row].nonzero().flatten().tolist()
        _, expected = masked_eager_forward(tiny, ids[row : row + 1], hidden=positions)
        assert (batched[row] - expected[0]).abs().max() <= ATOL


def test_modifiers_restore_the_model_after_an_exception(tiny):
    for factory in modifiers(tiny).values():
        with pytest.raises(RuntimeError, match="boom"), factory():
            assert tiny.config._attn_implementation == "longprobe"
            raise RuntimeError("boom")
        assert tiny.config._attn_implementation == "sdpa"
    ids = random_ids(tiny)
    _, plain = masked_eager_forward(tiny, ids)
    with torch.no_grad():
        assert (tiny(input_ids=ids, use_cache=False).logits - plain).abs().max() <= ATOL


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: probe.mask_keys(m, [-1]), IndexError, "non-negative"),
        (lambda m: probe.mask_keys(m, torch.zeros(SEQ, dtype=torch.bool)), ValueError, r"\[batch, seq\]"),
        (lambda m: probe.mask_keys(m, [600]), IndexError, "context"),
        (lambda m: probe.attention_window(m, 0), ValueError, "at least 1"),
    ],
)
def test_bad_modifier_arguments_are_refused(call, error, message):
    model = probe.tiny_model("llama")
    with pytest.raises(error, match=message), call(model):
        model(input_ids=random_ids(model), use_cache=False)


def test_a_batch_of_masks_must_match_the_batch():
    model = probe.tiny_model("llama")
    with (
        pytest.raises(ValueError, match="masks for 3 sequences"),
        probe.mask_keys(model, torch.zeros(3, SEQ, dtype=torch.bool)),
    ):
        model(input_ids=random_ids(model, batch=2), use_cache=False)


def test_two_gradient_traces_of_one_layer_are_refused():
    model = probe.tiny_model("llama")
    with pytest.raises(ValueError, match="grad=True"), probe.trace(model, rows=[3], grad=True):
        with probe.trace(model, rows=[5], grad=True):
            model(input_ids=random_ids(model), use_cache=False)


def test_a_model_that_builds_its_own_mask_is_detected(monkeypatch):
    model = probe.tiny_model("llama")
    monkeypatch.setattr("transformers.models.llama.modeling_llama.create_causal_mask", lambda **kwargs: None)
    with (
        pytest.raises(UnsupportedModelError, match="builds its attention mask itself"),
        probe.mask_keys(model, [2]),
    ):
        model(input_ids=random_ids(model), use_cache=False)
