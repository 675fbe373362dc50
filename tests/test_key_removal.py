"""The key-removal gradient and gradient × input: against autograd through explicit eager masks,
finite differences of the biased model, and the one-by-one shared pass."""

import pytest
import torch
from reference import explicit_masks

import probe
from probe import detectors, faithfulness
from probe.attention.modifiers import bias_keys, mask_keys
from probe.checks import cache_keyword
from probe.faithfulness import compaction
from probe.probes import key_removal
from probe.probes.key_removal import key_removal_gradient, removal_units
from probe.target import target_of

SEQ = 24
TARGETS = torch.tensor([21, 22, 23])


@pytest.fixture
def ids():
    return torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(0))


def eager_key_removal_gradient(
    model, ids, targets, bias: float | torch.Tensor = 0.0, spans=(), hidden=()
) -> torch.Tensor:
    """∂ Σ log P(targets)/∂b at b = ``bias`` (one value for every j, or Tensor[seq]), by autograd
    through eager attention under hand-built additive masks with b_j added to every entry (i, j),
    i > j, but those with i and j in one of ``spans`` [(start, end)], and the keys ``hidden`` masked:
    Tensor[seq]."""
    dtype = next(model.parameters()).dtype
    bias = torch.as_tensor(bias, dtype=dtype).expand(SEQ).clone().requires_grad_()
    later = torch.ones(SEQ, SEQ, dtype=dtype).tril(-1)
    for start, end in spans:
        later[start:end, start:end] = 0
    masks = {kind: mask + bias * later for kind, mask in explicit_masks(model, SEQ, hidden).items()}
    original = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        mask = masks if len(masks) > 1 else next(iter(masks.values()))
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[0, targets - 1]
    finally:
        model.set_attn_implementation(original)
    logprob = logits.log_softmax(-1).gather(-1, ids[0, targets, None]).sum()
    (grad,) = torch.autograd.grad(logprob, bias)
    return grad


@pytest.mark.parametrize("checkpoint", [False, True])
def test_key_removal_gradient_equals_eager_autograd(tiny, ids, checkpoint):
    expected = eager_key_removal_gradient(tiny, ids, TARGETS)
    got = key_removal_gradient(tiny, ids, TARGETS, checkpoint=checkpoint)
    assert (got - expected).abs().max() <= 1e-6
    assert expected.abs().max() > 1e-3  # not trivially zero
    assert got[-1] == 0  # no later query reads the last key
    assert not any(p.requires_grad is False for p in tiny.parameters())  # parameters restored


SPANS = [(2, 6), (9, 10), (12, 19)]


@pytest.mark.parametrize("checkpoint", [False, True])
def test_by_source_key_removal_gradient_equals_eager_autograd(tiny, ids, checkpoint):
    """Spans removed as units: no bias from a query on the keys of its own span."""
    expected = eager_key_removal_gradient(tiny, ids, TARGETS, spans=SPANS)
    got = key_removal_gradient(tiny, ids, TARGETS, checkpoint=checkpoint, sources=SPANS)
    assert (got - expected).abs().max() <= 1e-6
    plain = key_removal_gradient(tiny, ids, TARGETS)
    assert (got[2:6] - plain[2:6]).abs().max() > 1e-4  # the within-span pairs mattered
    assert (got[19:] - plain[19:]).abs().max() <= 1e-6  # after the last span nothing changes


@pytest.mark.parametrize("checkpoint", [False, True])
def test_key_removal_gradient_at_partial_presence_equals_eager_autograd(tiny, ids, checkpoint):
    """``presence=p``: the gradient at b = log p on every source token (0 elsewhere)."""
    start = torch.zeros(SEQ)
    for first, end in SPANS:
        start[first:end] = torch.tensor(0.5).log()
    expected = eager_key_removal_gradient(tiny, ids, TARGETS, bias=start, spans=SPANS)
    got = key_removal_gradient(tiny, ids, TARGETS, checkpoint=checkpoint, sources=SPANS, presence=0.5)
    assert (got - expected).abs().max() <= 1e-6
    whole = key_removal_gradient(tiny, ids, TARGETS, sources=SPANS)
    assert (got - whole).abs().max() > 1e-4  # the weights moved the gradient
    for options, message in [
        ({"presence": 0.0}, "presence"),
        ({"presence": 1.5}, "presence"),
        ({}, "sources"),
    ]:
        with pytest.raises(ValueError, match=message):
            key_removal_gradient(tiny, ids, TARGETS, **{"presence": 0.5} | options)


def test_the_shared_pass_at_partial_presence_reads_the_weighted_context(tiny, ids):
    """``answer_attribution(sources=, presence=½)``: its key-bias gradient is the eager one at b = log ½
    on the source tokens, and its attention rows are eager attention's under those biased masks (one pass
    reads the weighted context throughout); refused without the key bias or for several sequences."""
    start = torch.zeros(SEQ)
    for first, end in SPANS:
        start[first:end] = torch.tensor(0.5).log()
    one = probe.answer_attribution(tiny, ids, TARGETS, key_bias=True, sources=SPANS, presence=0.5)
    expected = eager_key_removal_gradient(tiny, ids, TARGETS, bias=start, spans=SPANS)
    assert (one.key_removal_gradient() - expected).abs().max() <= 1e-6
    later = torch.ones(SEQ, SEQ).tril(-1)
    for first, end in SPANS:
        later[first:end, first:end] = 0
    masks = {kind: mask + start * later for kind, mask in explicit_masks(tiny, SEQ).items()}
    original = tiny.config._attn_implementation
    tiny.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            mask = masks if len(masks) > 1 else next(iter(masks.values()))
            eager = tiny(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False)
    finally:
        tiny.set_attn_implementation(original)
    rows = torch.stack([layer[0][:, TARGETS - 1] for layer in eager.attentions])  # [layers, heads, rows, seq]
    assert (one.pattern - rows).abs().max() <= 1e-6
    whole = probe.answer_attribution(tiny, ids, TARGETS, key_bias=True, sources=SPANS)
    assert (one.pattern - whole.pattern).abs().max() > 1e-3  # the weights moved the attention
    with pytest.raises(ValueError, match="key_bias=True"):
        probe.answer_attribution(tiny, ids, TARGETS, sources=SPANS, presence=0.5)
    with pytest.raises(ValueError, match="one sequence"):
        probe.answer_attribution(tiny, [ids[0], ids[0]], [TARGETS, TARGETS], key_bias=True, sources=SPANS)
    with pytest.raises(ValueError, match="sources"):
        probe.answer_attribution(tiny, ids, TARGETS, key_bias=True, presence=0.5)


@pytest.mark.parametrize("compact", [True, False])
def test_key_removal_gradient_after_removing_tokens_equals_eager_autograd(tiny, ids, compact, monkeypatch):
    """``kept=``: the gradient in what is left once spans 0 and 2 are gone, run compacted at original
    positions (the 7-token gap is wider than tiny Gemma 3's window of 6) or key-masked, against
    autograd through eager attention with those keys hidden by hand-built masks."""
    if not compact:
        monkeypatch.setattr(key_removal, "compaction_supported", lambda model: False)
    kept = torch.ones(SEQ, dtype=torch.bool)
    kept[2:6] = kept[12:19] = False
    hidden = (~kept).nonzero()[:, 0].tolist()
    expected = eager_key_removal_gradient(tiny, ids, TARGETS, spans=SPANS, hidden=hidden)
    got = key_removal_gradient(tiny, ids, TARGETS, sources=SPANS, kept=kept)
    assert (got - expected).abs().max() <= 1e-6
    assert torch.equal(got[~kept], torch.zeros(len(hidden)))
    assert torch.equal(key_removal_gradient(tiny, ids, TARGETS, sources=SPANS, kept=kept.tolist()), got)
    whole = key_removal_gradient(tiny, ids, TARGETS, sources=SPANS)
    assert (got[kept] - whole[kept]).abs().max() > 1e-4  # the removal changed the others' gradients
    for bad, message in [
        (kept[:-1], "BoolTensor\\[24\\]"),
        (kept.int(), "BoolTensor"),
        (~kept, "before the answer"),
    ]:
        with pytest.raises(ValueError, match=message):
            key_removal_gradient(tiny, ids, TARGETS, kept=bad)


def test_removal_units_refuse_bad_spans(tiny, ids):
    assert removal_units([(1, 3)], 5).tolist() == [0, 5, 5, 3, 4]
    for spans, message in [
        ([(3, 3)], "not a span"),
        ([(0, SEQ + 1)], "not a span"),
        ([(2, 6), (5, 8)], "overlaps"),
        ([(0.5, 3)], "sources\\[0\\] start"),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            key_removal_gradient(tiny, ids, TARGETS, sources=spans)


def test_key_removal_gradient_equals_a_finite_difference_of_the_biased_model(tiny, ids):
    got = key_removal_gradient(tiny.double(), ids, TARGETS)
    eps = 1e-2  # central difference: O(eps²) error; parts of the model compute in fp32
    for j in (0, 3, 10, 17):
        values = []
        for step in (eps, -eps):
            bias = torch.zeros(1, SEQ, dtype=torch.float64)
            bias[0, j] = step
            with torch.no_grad(), bias_keys(tiny, bias):
                values.append(float(target_of(tiny, ids, TARGETS)))
        assert (values[0] - values[1]) / (2 * eps) == pytest.approx(float(got[j]), abs=5e-5)


def test_bias_keys_at_zero_changes_nothing_and_refuses_a_kv_cache(tiny, ids):
    with torch.no_grad():
        plain = tiny(input_ids=ids).logits
        with bias_keys(tiny, torch.zeros(SEQ)):
            biased = tiny(input_ids=ids, use_cache=False).logits
        assert torch.allclose(plain, biased, atol=1e-6)
        keyword = cache_keyword(tiny)
        past = tiny(input_ids=ids[:, :-1])[keyword]
        with pytest.raises(ValueError, match="without a KV cache"), bias_keys(tiny, torch.zeros(SEQ)):
            tiny(input_ids=ids[:, -1:], **{keyword: past})


def test_detectors_sum_their_first_order_effects_over_sources(tokenizer_sample):
    tokenizer, sample = tokenizer_sample
    model = probe.tiny_model("gemma3", vocab_size=len(tokenizer), max_position_embeddings=1024)
    found = detectors.detect_many(
        ["attention", "grad_times_input", "key_removal_grad"], model, tokenizer, sample
    )
    gradient = key_removal_gradient(model, sample.input_ids, sample.target_positions)
    assert torch.allclose(found["key_removal_grad"].scores, gradient, atol=1e-6)
    # a source's score is the sum of its tokens' (each checked against the gradient above)
    first = sample.sources[0]
    assert found["key_removal_grad"].details["source_scores"][0] == pytest.approx(
        float(found["key_removal_grad"].scores[first.start : first.end].sum())
    )
    alone = probe.detect("key_removal_grad", model, tokenizer, sample)  # the shared pass run for it
    assert torch.allclose(alone.scores, gradient, atol=1e-6) and gradient.abs().max() > 1e-3
    by_source = probe.detect("key_removal_banzhaf", model, tokenizer, sample, presence=1.0)
    spans = [(source.start, source.end) for source in sample.sources]
    units = key_removal_gradient(model, sample.input_ids, sample.target_positions, sources=spans)
    assert torch.allclose(by_source.scores, units)
    alone = probe.detect("grad_times_input", model, tokenizer, sample)
    assert torch.allclose(found["grad_times_input"].scores, alone.scores, atol=1e-6)
    # gradient × input by hand: e · ∂ Σ log P/∂e with a leaf embedding
    embeds = model.get_input_embeddings()(sample.input_ids[None]).detach().requires_grad_(True)
    targets = sample.target_positions
    logits = model(inputs_embeds=embeds, use_cache=False).logits[0, targets - 1]
    logits.log_softmax(-1).gather(-1, sample.input_ids[targets, None]).sum().backward()
    by_hand = (embeds * embeds.grad).sum(-1)[0]
    assert torch.allclose(alone.scores, by_hand, atol=1e-5)


@pytest.mark.parametrize("presence", [0.5, 1.0])
def test_key_removal_banzhaf_averages_the_gradient_over_complementary_half_contexts(
    tokenizer_sample, presence
):
    """By hand: the by-source gradient of the whole sequence at ``presence`` and under key masks that
    hide each half of ``pairs`` seeded random source halves (and its complement); a token's score is
    its mean over the contexts that keep it, so every source is averaged over ``pairs + 1`` of them."""
    tokenizer, sample = tokenizer_sample
    model = probe.tiny_model("gemma3", vocab_size=len(tokenizer), max_position_embeddings=1024)
    found = probe.detect("key_removal_banzhaf", model, tokenizer, sample, presence=presence, pairs=2, seed=5)
    spans = [(source.start, source.end) for source in sample.sources]
    ids, targets = sample.input_ids, sample.target_positions
    total = key_removal_gradient(model, ids, targets, sources=spans, presence=presence)
    count = torch.ones(len(ids))
    for half in faithfulness.random_masks(len(spans), 2, seed=5):
        for side in (half, ~half):
            hidden = torch.zeros(1, len(ids), dtype=torch.bool)
            hidden[0, compaction.removed_positions(sample.sources, ~side)] = True
            with mask_keys(model, hidden):
                total += key_removal_gradient(model, ids, targets, sources=spans)
            count += ~hidden[0]
    in_sources = torch.zeros(len(ids), dtype=torch.bool)
    for source in sample.sources:
        in_sources[source.start : source.end] = True
    assert set(count[in_sources].tolist()) == {3.0} and set(count[~in_sources].tolist()) == {5.0}
    assert torch.allclose(found.scores, total / count, atol=1e-6)
    first = sample.sources[0]
    assert found.details["source_scores"][0] == pytest.approx(
        float(found.scores[first.start : first.end].sum())
    )
    assert found.settings == {"top_k": 30, "presence": presence, "pairs": 2, "seed": 5}
    assert found.details["passes"] == 5


def test_key_removal_banzhaf_defaults_to_the_mean_field_gradient(tokenizer_sample):
    """``pairs=0`` (the default): one pass, the by-source gradient at every source's presence ½."""
    tokenizer, sample = tokenizer_sample
    model = probe.tiny_model("gemma3", vocab_size=len(tokenizer), max_position_embeddings=1024)
    found = probe.detect("key_removal_banzhaf", model, tokenizer, sample)
    spans = [(source.start, source.end) for source in sample.sources]
    mean_field = key_removal_gradient(
        model, sample.input_ids, sample.target_positions, sources=spans, presence=0.5
    )
    assert torch.equal(found.scores, mean_field)
    whole = key_removal_gradient(model, sample.input_ids, sample.target_positions, sources=spans)
    assert (found.scores - whole).abs().max() > 1e-4
    assert found.details["passes"] == 1 and found.settings["presence"] == 0.5
    for options, message in [({"pairs": -1}, "pairs"), ({"presence": 0.0}, "presence")]:
        with pytest.raises(ValueError, match=message):
            probe.detect("key_removal_banzhaf", model, tokenizer, sample, **options)


@pytest.fixture(scope="module")
def tokenizer_sample():
    from transformers import AutoTokenizer

    from probe import tasks

    tokenizer = AutoTokenizer.from_pretrained(probe.models.converted_folder("smollm2-135m"))
    return tokenizer, tasks.make("multihop-2", tokenizer, 300, seed=1)


def test_the_path_integrated_key_removal_gradient_is_complete(tiny, ids):
    """depth > 0: the midpoint rule over the biases' path from 0 to -depth, each point equal to
    autograd through eager attention at that bias; the scores add up to the log-probability lost
    when every bias is -depth (the rule's error shrinks with more steps)."""
    tiny = tiny.double()
    depth = 3.0

    def logprob_at(value: float) -> float:
        with torch.no_grad(), bias_keys(tiny, torch.full((1, SEQ), value, dtype=torch.float64)):
            return float(target_of(tiny, ids, TARGETS))

    lost = logprob_at(0.0) - logprob_at(-depth)
    errors = []
    for steps in (2, 32):
        got = key_removal_gradient(tiny, ids, TARGETS, depth=depth, steps=steps)
        biases = [-(k + 0.5) / steps * depth for k in range(steps)]
        points = [eager_key_removal_gradient(tiny, ids, TARGETS, bias=b) for b in biases]
        assert (got - depth * torch.stack(points).mean(0)).abs().max() <= 1e-6
        errors.append(abs(float(got.sum()) - lost))
    assert errors[1] < errors[0] / 50 and errors[1] < 2e-3 * abs(lost) and abs(lost) > 1e-2  # O(1/steps²)
    with pytest.raises(ValueError, match="steps > 1 needs depth > 0"):
        key_removal_gradient(tiny, ids, TARGETS, steps=4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_shared_pass_holds_each_samples_key_removal_gradient_in_a_padded_batch(tokenizer_sample, family):
    """Two samples of different lengths in one shared pass (padded, so the key bias runs under a mask):
    each one's ``key_removal_grad`` equals its own ``key_removal_gradient``; a pass without the bias
    says so, and a reader of gradients cannot declare a forward-only pass."""
    from probe import tasks

    tokenizer, _ = tokenizer_sample
    model = probe.tiny_model(family, vocab_size=len(tokenizer), max_position_embeddings=1024)
    samples = [tasks.make("multihop-2", tokenizer, length, seed=2) for length in (300, 240)]
    assert len(samples[0].input_ids) != len(samples[1].input_ids)
    found = detectors.detect_many(["information_flow", "key_removal_grad"], model, tokenizer, samples)
    for sample, one in zip(samples, found, strict=True):
        alone = key_removal_gradient(model, sample.input_ids, sample.target_positions)
        assert alone.abs().max() > 1e-4
        assert (one["key_removal_grad"].scores - alone).abs().max() <= 1e-5
    plain = probe.answer_attribution(model, samples[0].input_ids, samples[0].target_positions, [0])
    with pytest.raises(ValueError, match="key_bias=True"):
        plain.key_removal_gradient()
    with pytest.raises(ValueError, match="backward=True"):
        detectors.SharedPass(backward=False, key_bias=True)
