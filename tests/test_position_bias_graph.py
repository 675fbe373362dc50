"""Context selector against the dense product of eager attentions; closed forms against numeric products."""

from fractions import Fraction

import pytest
import torch
from reference import eager_forward

import probe
from probe.checks import UnsupportedModelError
from probe.probes import position_bias


def dense_selectors(model, ids: torch.Tensor, lams: list[float] | None = None, head: int | None = None):
    """The obvious way: all layers' eager ``output_attentions`` stacked, multiplied in float64: [L, S, S]."""
    attentions, _ = eager_forward(model, ids)
    product = torch.eye(ids.shape[1], dtype=torch.float64)
    products = []
    for layer, attention in enumerate(attentions):
        a = attention[0].detach().double()
        a = a.mean(0) if head is None else a[head]
        if lams is not None:
            a = lams[layer] * a + (1 - lams[layer]) * torch.eye(len(a), dtype=torch.float64)
        product = a @ product
        products.append(product)
    return torch.stack(products).float()


@pytest.mark.parametrize("mix", [None, 0.5])
def test_streamed_product_equals_dense_product(tiny, mix):
    ids = torch.randint(0, 128, (1, 23), generator=torch.Generator().manual_seed(1))
    streamed = probe.context_selector(tiny, ids, mix=mix, block_size=5)  # uneven row blocks
    lams = None if mix is None else [mix] * len(streamed)
    torch.testing.assert_close(streamed, dense_selectors(tiny, ids, lams), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(streamed.sum(-1), torch.ones(streamed.shape[:2]), atol=1e-6, rtol=0)
    assert streamed.triu(1).abs().max() == 0


def test_selected_layers_and_one_head(tiny):
    ids = torch.randint(0, 128, (1, 17), generator=torch.Generator().manual_seed(2))
    dense = dense_selectors(tiny, ids, head=1)
    streamed = probe.context_selector(tiny, ids, layers=[1, 0, -1], heads=1)  # negative: from the last
    torch.testing.assert_close(streamed, dense[[1, 0, -1]], atol=1e-6, rtol=1e-5)


def direct_measured_mix(model, ids: torch.Tensor) -> torch.Tensor:
    """The pre-generic computation: hooks on ``get_decoder().layers[t]`` and its ``self_attn``: [L]."""
    layers = model.get_decoder().layers
    inputs, outputs = {}, {}
    handles = [
        hook
        for t, layer in enumerate(layers)
        for hook in (
            layer.register_forward_pre_hook(
                lambda _, args, kwargs, t=t: inputs.__setitem__(t, (args or (kwargs["hidden_states"],))[0]),
                with_kwargs=True,
            ),
            layer.self_attn.register_forward_hook(lambda _, __, out, t=t: outputs.__setitem__(t, out[0])),
        )
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    ratios = []
    for t in range(len(layers)):
        x, a = inputs[t][0].float().norm(dim=-1), outputs[t][0].float().norm(dim=-1)
        ratios.append((a / (x + a).clamp(min=1e-12)).mean())
    return torch.stack(ratios)


def test_measured_mix_finds_attention_generically(tiny):
    ids = torch.randint(0, 128, (1, 19), generator=torch.Generator().manual_seed(4))
    modules = position_bias.attention_modules(tiny)
    assert [(layer, attention) for layer, attention in modules] == [
        (layer, layer.self_attn) for layer in tiny.get_decoder().layers
    ]
    measured = position_bias.measured_mix(tiny, ids)
    torch.testing.assert_close(measured, direct_measured_mix(tiny, ids), atol=0, rtol=0)


@pytest.mark.parametrize("broken", ["missing", "duplicate"])
def test_attention_modules_unsupported_model(broken):
    model = probe.tiny_model("llama")
    attention = model.model.layers[1].self_attn
    if broken == "missing":
        del attention.layer_idx
    else:
        attention.layer_idx = 0
    with pytest.raises(UnsupportedModelError, match="one attention module"):
        position_bias.measured_mix(model, torch.arange(8))


def test_measured_mix(tiny):
    ids = torch.randint(0, 128, (1, 19), generator=torch.Generator().manual_seed(3))
    lams = position_bias.measured_mix(tiny, ids)
    assert lams.shape == (len(tiny.model.layers),) and ((lams > 0) & (lams < 1)).all()
    torch.testing.assert_close(
        probe.context_selector(tiny, ids, mix="measured"),
        dense_selectors(tiny, ids, lams.tolist()),
        atol=1e-6,
        rtol=1e-5,
    )
    # with layer 0's attention output zeroed, that layer adds nothing: λ_0 = 0
    out_proj = tiny.model.layers[0].self_attn.o_proj.weight
    saved = out_proj.detach().clone()
    with torch.no_grad():
        out_proj.zero_()
    try:
        assert position_bias.measured_mix(tiny, ids)[0] == 0
    finally:
        with torch.no_grad():
            out_proj.copy_(saved)


def test_model_left_unchanged(tiny):
    ids = torch.randint(0, 128, (1, 11))
    before = (tiny.config._attn_implementation, tiny.training, [p.requires_grad for p in tiny.parameters()])
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in tiny.modules())
    probe.context_selector(tiny, ids, mix="measured")
    assert (
        tiny.config._attn_implementation,
        tiny.training,
        [p.requires_grad for p in tiny.parameters()],
    ) == before
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in tiny.modules()) == hooks


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"layers": [3]}, IndexError, "out of range"),
        ({"layers": [-4]}, IndexError, "out of range"),
        ({"layers": []}, ValueError, "layers is empty"),
        ({"mix": 1.5}, ValueError, "mix must be"),
        ({"mix": "rollout"}, ValueError, "mix must be"),
        ({"heads": 4}, ValueError, "heads must be"),
        ({"heads": "max"}, ValueError, "heads must be"),
    ],
)
def test_bad_input(kwargs, error, message):
    model = probe.tiny_model("llama")  # 3 layers, 4 heads
    with pytest.raises(error, match=message):
        probe.context_selector(model, torch.arange(8), **kwargs)


# --- theory --------------------------------------------------------------------------------------------


def test_cesaro_powers_match_the_verified_values():
    rows = position_bias.selector_rows(position_bias.cesaro(64), n_layers=8)  # row k: k + 1 layers
    assert [round(rows[t - 1, 0].item(), 4) for t in (2, 4, 8)] == [0.0741, 0.3447, 0.8661]
    tail = 1 - position_bias.selector_rows(position_bias.cesaro(64), n_layers=40)[:, 0]
    assert tail[39] / tail[38] == pytest.approx(0.5, abs=1e-3)  # second eigenvalue 1/2


@pytest.mark.parametrize("n_layers", [1, 2, 5])
def test_cesaro_closed_form_is_exact(n_layers):
    exact = position_bias.cesaro_exact_row(12, n_layers)
    assert sum(exact) == 1
    power = torch.linalg.matrix_power(position_bias.cesaro(12), n_layers)[-1]
    torch.testing.assert_close(
        torch.tensor([float(f) for f in exact], dtype=torch.float64), power, atol=1e-14, rtol=0
    )
    assert exact[0] == Fraction(1, 12) if n_layers == 1 else exact[0] > Fraction(1, 12)


@pytest.mark.parametrize("n_layers", [1, 2, 4, 8, 16, 32])
def test_decay_closed_form_is_negative_binomial(n_layers):
    numeric = position_bias.selector_rows(position_bias.decay_attention(64, 0.5), n_layers)[-1]
    ratio = numeric / position_bias.decay_closed_form(64, n_layers, 0.5)
    assert ((ratio[11:] - 1).abs() < 0.01).all()  # tokens j ≥ 12
    if n_layers >= 4:
        assert ratio[0] > 1.1  # the boundary inflation near token 1 the closed form leaves out


@pytest.mark.parametrize("n_layers", [1, 2, 4, 8])
def test_rope_interior_is_kernel_convolution(n_layers):
    numeric = position_bias.selector_rows(position_bias.rope_attention(128, 0.02, 20.0), n_layers)[-1]
    predicted = position_bias.rope_closed_form(128, n_layers, 0.02, 20.0)
    torch.testing.assert_close(numeric[64:], predicted[64:], atol=1e-12, rtol=1e-6)


def test_selector_rows_with_mixing_equal_matrix_powers():
    attention = position_bias.cesaro(20)
    mixed = 0.5 * attention + 0.5 * torch.eye(20, dtype=torch.float64)
    rows = position_bias.selector_rows(attention, 6, mix=0.5)
    torch.testing.assert_close(rows[5], torch.linalg.matrix_power(mixed, 6)[-1])
    lams = [0.9, 0.1, 0.5]
    product = torch.eye(20, dtype=torch.float64)
    for lam in lams:
        product = (lam * attention + (1 - lam) * torch.eye(20, dtype=torch.float64)) @ product
    torch.testing.assert_close(position_bias.selector_rows(attention, 3, mix=lams)[-1], product[-1])


def test_residual_mix_and_in_place_product():
    attention = position_bias.cesaro(7)
    assert position_bias.residual_mix(attention, None) is attention
    torch.testing.assert_close(
        position_bias.residual_mix(attention, 0.3), 0.3 * attention + 0.7 * torch.eye(7, dtype=torch.float64)
    )
    product = torch.eye(7, dtype=torch.float64)
    position_bias.multiply_in_place(product, attention, block_size=3)
    position_bias.multiply_in_place(product, attention, block_size=3)
    torch.testing.assert_close(product, attention @ attention)
    with pytest.raises(ValueError, match="not causal"):
        position_bias.multiply_in_place(product, attention.T.contiguous(), block_size=3)


# --- sinks ---------------------------------------------------------------------------------------------


def test_sink_rate_counts_edges_above_tau():
    seq = 5
    mask = position_bias.causal_mask(seq)
    attention = position_bias.cesaro(seq).float()[None]  # one layer; column j gets 1/i from rows i ≥ j
    expected = torch.tensor([(1 / torch.arange(j + 1, seq + 1) > 0.2).float().mean() for j in range(seq)])
    torch.testing.assert_close(position_bias.sink_rate(attention, mask), expected)
    sink = torch.zeros(seq, seq)
    sink[:, 0] = 1.0
    torch.testing.assert_close(
        position_bias.sink_rate(torch.stack([sink, attention[0]]), mask)[0], (1 + expected[0]) / 2
    )


def test_gu_sink():
    seq = 6
    sink = torch.zeros(2, seq, seq)
    sink[0, :, 0] = 1.0  # one head all on token 1: α_1 = 1
    sink[1] = position_bias.cesaro(seq).float()  # α_1 = H_6 / 6 ≈ 0.41 > 0.3; α_k small for k > 1
    rate = position_bias.gu_sink(sink)
    assert rate[0] == 1.0 and rate[1:].max() < 1.0
    assert position_bias.gu_sink(sink, epsilon=0.5)[0] == 0.5


def test_masks():
    assert position_bias.causal_mask(4).equal(torch.ones(4, 4, dtype=torch.bool).tril())
    window = position_bias.causal_mask(6, window=2)
    assert window.sum(1).tolist() == [1, 2, 2, 2, 2, 2]
    prefix = position_bias.causal_mask(5, prefix=2)
    assert prefix[0, 1] and prefix[:, :2].all() and not prefix[2, 3]


@pytest.mark.real
def test_real_model_selector_equals_dense_product(smollm2):
    """SmolLM2 (GQA 9/3 heads, 30 layers) on essay text: streamed = dense, and the raw product collapses."""
    from probe.tasks.noise import sentences

    model, tokenizer = smollm2
    ids = tokenizer(" ".join(sentences()[:20]), return_tensors="pt").input_ids[:, :48]
    streamed = probe.context_selector(model, ids, layers=[0, 4, -1], block_size=16)
    torch.testing.assert_close(streamed, dense_selectors(model, ids)[[0, 4, 29]], atol=1e-5, rtol=1e-4)
    assert streamed[-1, -1, 0] > 0.9  # Thm 4.1: deep raw products put (almost) all mass on token 1
