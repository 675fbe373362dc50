"""The capture core and its probes against eager-attention references (fp32, max abs diff ≤ 1e-5)."""

import copy

import pytest
import torch
from reference import eager_forward, embedding_grad_reference, information_flow_reference

import probe
from probe.checks import UnsupportedModelError, cache_keyword

ATOL = 1e-5
SEQ = 24  # longer than the tiny Gemma's sliding window (6), so sliding masks matter


def random_ids(model, seq=SEQ, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, seq), generator=generator)


def test_attention_rows_match_eager(tiny):
    ids = random_ids(tiny)
    rows = [0, 3, 11, SEQ - 1]
    attentions, _ = eager_forward(tiny, ids)
    expected = torch.stack([a[0][:, rows] for a in attentions])
    got = probe.attention_rows(tiny, ids, rows)
    assert got.shape == (tiny.config.num_hidden_layers, tiny.config.num_attention_heads, len(rows), SEQ)
    assert (got - expected).abs().max() <= ATOL
    assert torch.allclose(got.sum(-1), torch.ones(()), atol=ATOL)


def test_sliding_window_rows_see_only_the_window():
    model = probe.tiny_model("gemma3")
    rows = probe.attention_rows(model, random_ids(model), [SEQ - 1], layers=[0, 1])
    window = model.config.sliding_window
    assert (rows[0, ..., : SEQ - window] == 0).all()  # layer 0 slides
    assert (rows[1, ..., : SEQ - window] > 0).all()  # layer 1 is global


def test_attention_matrices_in_blocks_match_eager(tiny):
    ids = random_ids(tiny)
    attentions, _ = eager_forward(tiny, ids)
    expected = torch.stack([a[0] for a in attentions])
    got = probe.attention_matrices(tiny, ids, block_size=5)  # 24 rows: uneven blocks
    assert (got - expected).abs().max() <= ATOL

    streamed = {}
    assert probe.attention_matrices(tiny, ids, layers=[1, -1], on_layer=streamed.__setitem__) is None
    assert sorted(streamed) == [1, tiny.config.num_hidden_layers - 1]
    assert (streamed[1] - expected[1]).abs().max() <= ATOL


@pytest.mark.parametrize("reduce", ["sum_then_abs", "abs_then_sum"])
def test_information_flow_matches_retain_grad(tiny, reduce):
    ids = random_ids(tiny)
    targets = torch.tensor([5, 17, SEQ - 1])
    expected = information_flow_reference(tiny, ids, targets, reduce)
    got = probe.information_flow(tiny, ids, targets, reduce=reduce)
    assert got.shape == (tiny.config.num_hidden_layers, SEQ)
    assert expected.abs().max() > 1e-3  # the comparison is not between zeros
    assert (got - expected).abs().max() <= ATOL
    subset = probe.information_flow(tiny, ids, targets, layers=[-1, 0], reduce=reduce)
    assert (subset - expected[[-1, 0]]).abs().max() <= ATOL


@pytest.mark.parametrize("p", [2, 1])
def test_embedding_grad_norms_match_retain_grad(tiny, p):
    ids = random_ids(tiny)
    targets = torch.tensor([9, SEQ - 1])
    expected = embedding_grad_reference(tiny, ids, targets, p)
    got = probe.embedding_grad_norms(tiny, ids, targets, p=p)
    assert got.shape == (SEQ,)
    assert (got - expected).abs().max() <= ATOL
    assert got[targets.max() :].eq(0).all()  # tokens after the last predicting row cannot matter


def test_probes_leave_the_model_as_they_found_it(tiny):
    tiny.train()
    tiny.model.layers[0].mlp.requires_grad_(False)
    flags = [p.requires_grad for p in tiny.parameters()]
    probe.information_flow(tiny, random_ids(tiny), [4])
    probe.embedding_grad_norms(tiny, random_ids(tiny), [4])
    assert tiny.training
    assert [p.requires_grad for p in tiny.parameters()] == flags
    assert all(p.grad is None for p in tiny.parameters())  # frozen: no parameter gradients
    assert tiny.config._attn_implementation == "sdpa"


def test_trace_restores_after_an_exception(tiny):
    with pytest.raises(RuntimeError, match="boom"), probe.trace(tiny, rows=[1]):
        assert tiny.config._attn_implementation == "longprobe"
        raise RuntimeError("boom")
    assert tiny.config._attn_implementation == "sdpa"


def test_trace_captures_the_decoding_row_under_a_kv_cache(tiny):
    ids = random_ids(tiny)
    with torch.no_grad():
        keyword = cache_keyword(tiny)
        past = tiny(input_ids=ids[:, :-1], use_cache=True)[keyword]
        with probe.trace(tiny, rows=[0]) as cache:
            tiny(input_ids=ids[:, -1:], use_cache=True, **{keyword: past})
    attentions, _ = eager_forward(tiny, ids)
    for layer, attention in enumerate(attentions):
        got = cache["pattern", layer][0, :, 0]
        expected = attention[0, :, -1, -got.shape[-1] :]  # a sliding cache keeps only the window
        assert (got - expected).abs().max() <= ATOL


def test_cache_uses_transformerlens_names(tiny):
    with torch.no_grad(), probe.trace(tiny, rows=[2, 3], layers=[0, -1]) as cache:
        tiny(input_ids=random_ids(tiny), use_cache=False)
    last = tiny.config.num_hidden_layers - 1
    assert set(cache) == {"blocks.0.attn.hook_pattern", f"blocks.{last}.attn.hook_pattern"}
    assert cache["pattern", -1] is cache[f"blocks.{last}.attn.hook_pattern"]
    assert cache.stack("pattern", [0, last]).shape[:3] == (2, tiny.config.num_attention_heads, 2)


def test_bridge_hook_pattern_equals_our_cache(smollm2):
    model = probe.tiny_model("llama", vocab_size=smollm2[1].vocab_size)
    bridge = probe.to_bridge(model, smollm2[1], name="tiny-llama")
    ids = random_ids(model)
    _, bridge_cache = bridge.run_with_cache(ids, names_filter=lambda name: name.endswith("attn.hook_pattern"))
    ours = probe.attention_matrices(model, ids)
    for layer in range(model.config.num_hidden_layers):
        name = f"blocks.{layer}.attn.hook_pattern"
        assert (bridge_cache[name][0] - ours[layer]).abs().max() <= ATOL
    assert model.config._attn_implementation == "sdpa"  # the copy was rewired, not the model
    with pytest.raises(UnsupportedModelError, match="to_bridge"):
        probe.attention_rows(bridge, ids, [1])


# --- clear failures -------------------------------------------------------------------------


def test_sequence_longer_than_context_is_refused(tiny):
    ids = random_ids(tiny, seq=tiny.config.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="longer than the model's context"):
        probe.attention_rows(tiny, ids, [0])


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m, ids: probe.attention_rows(m, ids, [SEQ]), IndexError, "out of range"),
        (lambda m, ids: probe.attention_rows(m, ids, [-1]), IndexError, "out of range"),
        (lambda m, ids: probe.attention_rows(m, ids, []), ValueError, "empty"),
        (lambda m, ids: probe.attention_rows(m, ids, [1], layers=[99]), IndexError, "layers"),
        (lambda m, ids: probe.information_flow(m, ids, [0]), IndexError, "no preceding row"),
        (lambda m, ids: probe.information_flow(m, ids, [3], reduce="max"), ValueError, "reduce"),
        (lambda m, ids: probe.embedding_grad_norms(m, ids, [SEQ + 4]), IndexError, "out of range"),
        (lambda m, ids: probe.embedding_grad_norms(m, ids, [3, 3]), ValueError, "repeated"),
    ],
)
def test_bad_positions_are_refused(call, error, message):
    model = probe.tiny_model("llama")
    with pytest.raises(error, match=message):
        call(model, random_ids(model))


def test_non_hf_model_is_refused():
    with pytest.raises(UnsupportedModelError, match="PreTrainedModel"):
        probe.attention_rows(torch.nn.Linear(2, 2), [1, 2, 3], [0])


def test_attention_outside_the_interface_is_detected(monkeypatch):
    model = probe.tiny_model("llama")
    monkeypatch.setattr(type(model), "_can_set_attn_implementation", lambda self: False)
    with pytest.raises(UnsupportedModelError, match="AttentionInterface"):
        probe.attention_rows(model, random_ids(model), [1])


def test_attention_that_never_reaches_the_function_is_detected():
    model = probe.tiny_model("llama")
    for layer in model.model.layers:  # an attention that computes its output by other means
        layer.self_attn.forward = lambda hidden_states, **kwargs: (torch.zeros_like(hidden_states), None)
    with pytest.raises(UnsupportedModelError, match="reached"):
        probe.attention_rows(model, random_ids(model), [1])


# --- the real model -------------------------------------------------------------------------


@pytest.mark.real
def test_real_smollm2_matches_eager_at_256_tokens(smollm2):
    model, tokenizer = smollm2
    text = "The pass key is 71432. Remember it. " + "The grass is green. The sky is blue. " * 30
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :256]
    targets = torch.tensor([6, 7, 8, 255])
    layers = [0, 17, 18, 29]
    attentions, _ = eager_forward(model, ids)
    rows = probe.attention_rows(model, ids, targets - 1, layers=layers)
    expected_rows = torch.stack([attentions[layer][0][:, targets - 1] for layer in layers])
    assert (rows - expected_rows).abs().max() <= ATOL
    del attentions

    expected_flow = information_flow_reference(model, ids, targets)
    assert (probe.information_flow(model, ids, targets) - expected_flow).abs().max() <= ATOL
    # Gradient norms here reach ~6, where 1e-5 is ~20 fp32 ulps and the two paths sum in different
    # orders (full vs kept logits); in float64 the same comparison has no rounding excuse at all.
    double = copy.deepcopy(model).double()
    expected_grad = embedding_grad_reference(double, ids, targets)
    assert (probe.embedding_grad_norms(double, ids, targets) - expected_grad).abs().max() <= 1e-10


# --- activation checkpointing -----------------------------------------------------------------


def test_checkpointed_layers_recompute_and_record_once(tiny, monkeypatch):
    ids = random_ids(tiny)
    targets = torch.tensor([5, 17, SEQ - 1])
    layers = tiny.config.num_hidden_layers
    plain_flow = probe.information_flow(tiny, ids, targets)
    plain_grads = probe.embedding_grads(tiny, ids, targets)
    calls = []
    original = probe.attention.capture.pattern_blocks
    counted = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(probe.attention.capture, "pattern_blocks", counted)
    with probe.memory.checkpointing.checkpointed(tiny):
        flow = probe.information_flow(tiny, ids, targets)
        with probe.trace(tiny, rows=targets - 1, grad=True) as cache:
            embeds = tiny.get_input_embeddings()(ids).detach().requires_grad_(True)
            probe.target_loss(tiny, ids, targets, inputs_embeds=embeds).backward()
    assert len(calls) == 2 * 2 * layers  # each layer's rows computed in the forward and again in the backward
    assert (flow - plain_flow).abs().max() <= 1e-6
    assert (embeds.grad[0] - plain_grads).abs().max() <= 1e-6
    assert len(cache) == 2 * layers  # pattern and pattern_grad once per layer
    assert not any("forward" in vars(module) for module in tiny.modules())  # layers restored
    tiny.zero_grad(set_to_none=True)


def test_checkpointed_recomputation_keeps_the_modifiers(tiny):
    ids = random_ids(tiny)
    targets = torch.tensor([11, SEQ - 1])
    with probe.mask_keys(tiny, [2, 5, 9]), probe.attention_window(tiny, 8):
        plain = probe.information_flow(tiny, ids, targets)
        with probe.memory.checkpointing.checkpointed(tiny):
            checkpointed = probe.information_flow(tiny, ids, targets)
    assert (checkpointed - plain).abs().max() <= 1e-6


def test_checkpointed_refuses_a_kv_cache_and_models_without_layers(tiny, monkeypatch):
    with probe.memory.checkpointing.checkpointed(tiny), pytest.raises(ValueError, match="use_cache=False"):
        tiny(input_ids=random_ids(tiny), use_cache=True)
    assert not any("forward" in vars(module) for module in tiny.modules())
    monkeypatch.setattr(
        probe.memory.checkpointing, "GradientCheckpointingLayer", type("Other", (torch.nn.Module,), {})
    )
    with pytest.raises(UnsupportedModelError, match="GradientCheckpointingLayer"):
        with probe.memory.checkpointing.checkpointed(tiny):
            pass


# --- reduced precision -------------------------------------------------------------------------


def test_bf16_rows_are_recomputed_in_fp32_and_stay_close_to_fp64(tiny):
    """In a bf16 model the q/k themselves carry bf16 rounding; the captured rows, recomputed from
    them in fp32, are as close to the fp64 model as eager bf16 attention is (here ≤ 2e-2 absolute),
    and information flow stays within 5% of fp64 (relative to its largest value)."""
    ids = random_ids(tiny)
    rows, targets = [3, 11, SEQ - 1], torch.tensor([12, SEQ - 1])
    double, half = copy.deepcopy(tiny).double(), copy.deepcopy(tiny).to(torch.bfloat16)
    reference = torch.stack([a[0][:, rows] for a in eager_forward(double, ids)[0]])
    eager_half = torch.stack([a[0][:, rows] for a in eager_forward(half, ids)[0]]).double()
    got = probe.attention_rows(half, ids, rows)
    assert got.dtype == torch.float32
    error = (got.double() - reference).abs().max()
    assert error <= 2e-2 and error <= (eager_half - reference).abs().max() * 1.05
    flow = probe.information_flow(half, ids, targets).double()
    expected = probe.information_flow(double, ids, targets)
    assert (flow - expected).abs().max() <= 5e-2 * expected.abs().max()


def test_sliding_layers_attend_in_bands_exactly(monkeypatch):
    """Beyond two windows, a sliding layer's attention runs in bands of one window of queries and their
    reachable keys (probe.attention.kernels.windowed_sdpa); logits and information flow equal eager
    attention."""
    model = probe.tiny_model("gemma3")  # window 6; layers 0 and 2 slide
    ids = random_ids(model, seq=50)
    targets = torch.tensor([30, 49])
    bands = []
    real = probe.attention.kernels.windowed_sdpa
    counted = lambda *a, **k: bands.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(probe.attention.kernels, "windowed_sdpa", counted)
    flow = probe.information_flow(model, ids, targets)
    assert len(bands) == 2  # the two sliding layers, once each
    assert (flow - information_flow_reference(model, ids, targets)).abs().max() <= 1e-5
    with torch.no_grad(), probe.trace(model, rows=[49]):
        logits = model(input_ids=ids).logits
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert (logits - expected).abs().max() <= 1e-5
