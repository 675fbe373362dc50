"""The key bias on the CPU flash kernel against the biased mask on sdpa's math kernel."""

from contextlib import ExitStack

import pytest
import torch
import torch.nn.functional as F

from probe import attention
from probe.attention import flash_key_bias, kernels
from probe.attention.capture import trace
from probe.attention.flash_key_bias import Excluded, key_biased_attention, unit_runs
from probe.attention.modifiers import KeyBias, bias_keys
from probe.attention.shared_state import frozen_parameters
from probe.shapes import Shapes
from probe.target import target_of

N, HEADS, KV_HEADS, DIM = 40, 4, 2, 8
UNITS = torch.arange(N)
UNITS[5:12], UNITS[20:31] = N, N + 1  # two multi-token units


def reference(query, key, value, mask, bias, rows: slice, keys: slice) -> torch.Tensor:
    """sdpa (math kernel) under the whole biased mask of :func:`probe.attention.kernels.key_biased_mask`,
    cut to the call."""
    causal = torch.zeros(1, 1, N, N).masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -torch.inf)
    whole = kernels.key_biased_mask(causal if mask is None else mask, query, query, None, bias, UNITS)
    groups = HEADS // KV_HEADS
    return F.scaled_dot_product_attention(
        query[:, :, rows],
        key[:, :, keys].repeat_interleave(groups, 1),
        value[:, :, keys].repeat_interleave(groups, 1),
        attn_mask=whole[:, :, rows, keys],
        scale=0.3,
    ).transpose(1, 2)


@pytest.mark.parametrize("batch_bias", [1, 2])
@pytest.mark.parametrize("presence", [1.0, 0.5])
@pytest.mark.parametrize("call", ["causal", "masked", "band"])
def test_the_flash_key_bias_equals_the_biased_mask(call, presence, batch_bias):
    """Output and the gradients of q, k, v and the bias, to 1e-5 (fp32): no mask, a window with a
    hidden key, and one band of a sliding layer (queries 18–29 over keys 9–29)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, HEADS, N, DIM, generator=generator, requires_grad=True)
    key = torch.randn(2, KV_HEADS, N, DIM, generator=generator, requires_grad=True)
    value = torch.randn(2, KV_HEADS, N, DIM, generator=generator, requires_grad=True)
    bias = torch.randn(batch_bias, N, generator=generator) * (presence < 1)
    bias = (bias + torch.where(UNITS >= N, torch.tensor(presence).log(), 0.0)).requires_grad_()
    mask, rows, keys = None, slice(0, N), slice(0, N)
    if call != "causal":
        positions = torch.arange(N)
        allowed = (positions[None] <= positions[:, None]) & (positions[None] > positions[:, None] - 10)
        allowed[:, 3] = positions == 3  # key 3 hidden from every other query
        mask = torch.zeros(1, 1, N, N).masked_fill(~allowed, -torch.inf)
    if call == "band":
        rows, keys = slice(18, 30), slice(9, 30)
    band = None if mask is None else mask[:, :, rows, keys]
    excluded = Excluded(rows.start, keys.start, unit_runs(UNITS))
    got = key_biased_attention(
        query[:, :, rows], key[:, :, keys], value[:, :, keys], lambda: band, bias[:, keys], excluded, 0.3
    )
    expected = reference(query, key, value, mask, bias, rows, keys)
    weights = torch.randn(got.shape, generator=generator)
    inputs = [query, key, value, bias]
    got_grads = torch.autograd.grad((got * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    assert (got - expected).abs().max() <= 1e-5
    for got_grad, expected_grad in zip(got_grads, expected_grads, strict=True):
        assert (got_grad - expected_grad).abs().max() <= 1e-5
    assert expected_grads[3].abs().max() > 1e-2  # the bias matters


def test_unit_runs_are_the_multi_token_units():
    assert unit_runs(UNITS) == ((5, 12), (20, 31))
    assert unit_runs(None) == ()


def on_the_math_kernel(monkeypatch) -> None:
    """Send every key bias to sdpa's math kernel under the biased mask (the reference path)."""
    monkeypatch.setattr(attention, "fused_key_bias", lambda *args: False)


@pytest.mark.parametrize("block", [512, 5])
@pytest.mark.parametrize("presence", [1.0, 0.5])
def test_bias_keys_runs_the_flash_kernel_and_matches_the_math_kernel(tiny, presence, block, monkeypatch):
    """Tiny Llama (GQA) and Gemma 3 (window 6 < 24 tokens: bands): the gradient of the answer's
    log-probability by the bias, flash kernel against math kernel, to 1e-6; ``block`` 5: the rows of
    a full layer under a mask run in blocks of 5 (:data:`probe.attention.kernels.KEY_BIAS_BLOCK`). With a
    trace beside the bias (it rebuilds the answer rows with the bias) the bias's gradient, the
    captured rows and their gradients equal the math kernel's too."""
    monkeypatch.setattr(kernels, "KEY_BIAS_BLOCK", block)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([21, 22, 23])
    units = torch.arange(24)
    units[2:6], units[12:19] = 24, 25
    start = torch.where(units >= 24, torch.tensor(presence).log(), 0.0)[None]
    calls = []
    flash = flash_key_bias.key_biased_attention
    monkeypatch.setattr(kernels, "key_biased_attention", lambda *args: calls.append(1) or flash(*args))
    layers = list(range(tiny.config.num_hidden_layers))

    def gradient(traced: bool) -> tuple[torch.Tensor, dict]:
        bias = start.clone().requires_grad_()
        with ExitStack() as stack:
            stack.enter_context(bias_keys(tiny, bias, units))
            stack.enter_context(frozen_parameters(tiny))
            rows = targets - 1
            cache = stack.enter_context(trace(tiny, rows=rows, layers=layers, grad=True)) if traced else {}
            (grad,) = torch.autograd.grad(target_of(tiny, ids, targets), bias)
        return grad, dict(cache)

    for traced in (False, True):
        calls.clear()
        fast, fast_cache = gradient(traced)
        assert len(calls) >= tiny.config.num_hidden_layers
        with monkeypatch.context() as patched:
            on_the_math_kernel(patched)
            calls.clear()
            slow, slow_cache = gradient(traced)
            assert not calls
        assert (fast - slow).abs().max() <= 1e-6
        assert slow.abs().max() > 1e-3
        assert fast_cache.keys() == slow_cache.keys()
        for name, captured in slow_cache.items():
            assert (fast_cache[name] - captured).abs().max() <= 1e-6, name


@pytest.mark.parametrize("block", [512, 5, 1])  # 1: the sliding layers' bands are the largest
def test_the_planned_key_bias_term_holds_the_masks_the_kernel_builds(tiny, block, monkeypatch):
    """The largest mask a flash call of the key bias builds (the model's rows and the compensated
    copy) is the one :meth:`probe.attention.modifiers.KeyBias.memory` plans for: blocks of ``block`` rows on a
    full layer, one window's band on a sliding one (Gemma 3: window 6 < 25 tokens)."""
    monkeypatch.setattr(kernels, "KEY_BIAS_BLOCK", block)
    n = 25  # a multiple of every block's rows: the last block is whole
    built = []
    compensate = flash_key_bias._with_compensation

    def recorded(mask, *args):
        full = compensate(mask, *args)
        built.extend(t.numel() for t in (mask, full) if t is not None)
        return full

    monkeypatch.setattr(flash_key_bias, "_with_compensation", recorded)
    ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(1))
    bias = torch.full((1, n), -0.7, requires_grad=True)  # log ½ on every key: the masked path
    with bias_keys(tiny, bias), frozen_parameters(tiny):
        torch.autograd.grad(target_of(tiny, ids, torch.tensor([n - 1])), bias)
    shapes = Shapes.of(tiny)
    planned = KeyBias(bias).memory(shapes, n, 1, False, [KeyBias(bias)])["key_bias"]
    largest = max(kernels.key_bias_mask_elements(window, n) for window in shapes.windows)
    assert max(built) == largest
    assert planned == largest * (2 * shapes.act_bytes + 1)
