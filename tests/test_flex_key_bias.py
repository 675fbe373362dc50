"""The key bias on FlexAttention (:mod:`probe.attention.flex_key_bias`, CUDA's fused key bias) against
the biased mask on sdpa's math kernel, on the CPU.

What runs here: FlexAttention's eager implementation (the dense reference of the same score and mask
functions) and its graph compiled with the ``aot_eager`` backend (Dynamo's trace and AOT autograd's
joint graph, which inductor lowers to the fused kernel on CUDA). Eager FlexAttention refuses a backward
through CPU queries, keys or values (and runs on no other device this suite has: the virtual device is
not one it accepts), so the layer tests give the bias alone a gradient, and the model tests, which need
the gradient through every layer, lift that refusal (:func:`cpu_backward`): the refusal is a check in
``flex_attention``'s front end, the dense backward behind it is device-generic. Not run here: the
Triton kernel itself (inductor's lowering, its block skipping), which needs a GPU.
"""

from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.nn.attention import flex_attention as flex_api

from probe import attention
from probe.attention import FLASH, FLEX, flex_key_bias, fused_key_bias
from probe.attention.capture import trace
from probe.attention.flex_key_bias import BLOCK_MASK_BYTES, key_biased_flex_attention
from probe.attention.kernels import key_biased_mask
from probe.attention.modifiers import KeyBias, bias_keys
from probe.attention.patterns import Logits
from probe.attention.shared_state import frozen_parameters
from probe.probes.key_removal import key_removal_gradient
from probe.shapes import Shapes

N, HEADS, KV_HEADS, DIM, SCALE = 40, 4, 2, 8, 0.3
UNITS = torch.arange(N)
UNITS[5:12], UNITS[20:31] = N, N + 1  # two multi-token units


def close(got: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    """``got`` equals ``expected`` to ``rtol`` of the latter's largest entry, which is not ~0."""
    assert expected.abs().max() > 1e-3  # not trivially zero
    assert (got - expected).abs().max() <= rtol * expected.abs().max()


def layer_inputs(batch_bias: int, presence: float, grad: bool, seed: int = 0):
    """q [2, 4, N, 8], k and v [2, 2, N, 8] (GQA), a bias [batch_bias, N] with a gradient: random, and
    log ``presence`` on the units' tokens."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(2, HEADS, N, DIM, generator=generator, requires_grad=grad)
    key = torch.randn(2, KV_HEADS, N, DIM, generator=generator, requires_grad=grad)
    value = torch.randn(2, KV_HEADS, N, DIM, generator=generator, requires_grad=grad)
    bias = torch.randn(batch_bias, N, generator=generator)
    bias = (bias + torch.where(UNITS >= N, torch.tensor(presence).log(), 0.0)).requires_grad_()
    return query, key, value, bias


def model_mask(kind: str) -> tuple[torch.Tensor | None, int | None]:
    """(the mask transformers would pass, the layer's window): none (causal), none with a window of 10
    (a sliding layer), or a mask [2, 1, N, N] that differs by sequence: a window of 10, key 3 hidden
    from every other query, and in sequence 1 the first 4 keys too (left padding), as booleans or
    additive (there also −0.5 on every third key it allows)."""
    if kind in ("causal", "window"):
        return None, 10 if kind == "window" else None
    positions = torch.arange(N)
    allowed = (positions[None] <= positions[:, None]) & (positions[None] > positions[:, None] - 10)
    allowed[:, 3] = positions == 3
    allowed = allowed.expand(2, 1, N, N).clone()
    allowed[1, 0, :, :4] = False
    allowed[1, 0, :4, :4] = torch.eye(4, dtype=torch.bool)  # a padded row still sees itself
    if kind == "bool":
        return allowed, None
    return torch.where(allowed, -0.5 * (positions % 3 == 0), -torch.inf), None


def reference(query, key, value, mask, window, bias, units) -> torch.Tensor:
    """sdpa (math kernel) under the whole biased mask of :func:`key_biased_mask`: [batch, N, heads, dim]."""
    rows = torch.arange(N)
    allowed = rows[None] <= rows[:, None]
    if window is not None:
        allowed &= rows[None] > rows[:, None] - window
    causal = torch.zeros(1, 1, N, N).masked_fill(~allowed, -torch.inf)
    whole = key_biased_mask(causal if mask is None else mask, query, key, None, bias, units)
    key, value = (tensor.repeat_interleave(HEADS // KV_HEADS, 1) for tensor in (key, value))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=whole, scale=SCALE).transpose(1, 2)


def against_reference(flex, kind: str, batch_bias: int, presence: float, units, grad: bool, seed: int = 0):
    """``flex(query, key, value, mask, logits, bias, units)`` and its gradients (of the bias; of q, k, v
    too with ``grad``) against :func:`reference`'s, to 1e-5 of each reference's largest entry."""
    query, key, value, bias = layer_inputs(batch_bias, presence, grad, seed)
    mask, window = model_mask(kind)
    got = flex(query, key, value, mask, Logits(SCALE, sliding_window=window), bias, units)
    expected = reference(query, key, value, mask, window, bias, units)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed + 1))
    inputs = [bias, query, key, value] if grad else [bias]
    got_grads = torch.autograd.grad((got * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    assert got.shape == expected.shape and got.is_contiguous()
    close(got, expected)
    for got_grad, expected_grad in zip(got_grads, expected_grads, strict=True):
        close(got_grad, expected_grad)


KINDS = ["causal", "window", "bool", "additive"]


@pytest.mark.parametrize("units", [UNITS, None], ids=["units", "tokens"])
@pytest.mark.parametrize("batch_bias", [1, 2])
@pytest.mark.parametrize("presence", [1.0, 0.5])
@pytest.mark.parametrize("kind", KINDS)
def test_the_flex_key_bias_equals_the_biased_mask(kind, presence, batch_bias, units):
    """One layer through FlexAttention's public API as shipped (the bias alone has a gradient): the
    output and the key-removal gradient ∂L/∂b, GQA, scale 0.3; causal, a sliding window, and a
    per-sequence mask (boolean and additive); a bias per sequence or shared; multi-token units."""
    against_reference(key_biased_flex_attention, kind, batch_bias, presence, units, grad=False)


@pytest.mark.parametrize("kind", KINDS)
def test_the_compiled_flex_key_bias_equals_the_biased_mask_and_compiles_once(kind, monkeypatch):
    """Compiled as on CUDA, with the ``aot_eager`` backend: Dynamo's full graph and AOT autograd's
    gradient of the captured bias equal the reference; a second call with new tensors (bias, units,
    the model's mask) reuses the graph: no recompilation."""
    monkeypatch.setattr(flex_key_bias, "_biased_flex", flex_key_bias._compiled("aot_eager"))
    against_reference(key_biased_flex_attention, kind, 1, 0.5, UNITS, grad=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        against_reference(key_biased_flex_attention, kind, 1, 0.5, UNITS.clone(), grad=False, seed=2)


@pytest.fixture
def cpu_backward(monkeypatch):
    """Let eager FlexAttention run a backward through CPU queries, keys and values: its front end
    refuses them (``_validate_device``); the dense implementation behind it is device-generic."""
    validate = flex_api._validate_device  # its other checks (the devices) still run, on detached tensors
    monkeypatch.setattr(flex_api, "_validate_device", lambda *qkv: validate(*(t.detach() for t in qkv)))


@pytest.mark.parametrize("kind", KINDS)
def test_the_flex_key_bias_gradients_of_q_k_v(kind, cpu_backward):
    """With the CPU refusal lifted: the gradients of q, k and v equal the reference's too."""
    against_reference(key_biased_flex_attention, kind, 2, 0.5, UNITS, grad=True)


def on_flex(monkeypatch, calls: list) -> None:
    """Send every fused key bias to FlexAttention (as on CUDA), counting its calls."""
    dispatch, flex = attention.fused_key_bias, attention.key_biased_flex_attention
    monkeypatch.setattr(attention, "fused_key_bias", lambda *args: dispatch(*args) and FLEX)
    monkeypatch.setattr(attention, "key_biased_flex_attention", lambda *args: calls.append(1) or flex(*args))


@pytest.mark.parametrize("presence", [1.0, 0.5])
def test_bias_keys_on_flex_equals_the_math_kernel(tiny, presence, cpu_backward, monkeypatch):
    """Tiny Llama (GQA) and Gemma 3 (window 6 < 24 tokens, 2 query heads over 1 KV head): the key-removal
    gradient by source (multi-token units; presence ½: a nonzero bias), the logits under a random bias
    and, with a trace beside the bias, the captured rows and their gradients: FlexAttention against the
    biased mask on sdpa's math kernel, to 1e-5 of the largest entry."""
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    targets, sources = torch.tensor([21, 22, 23]), [(2, 6), (9, 10), (12, 19)]
    bias = torch.randn(1, 24, generator=torch.Generator().manual_seed(1))
    layers = list(range(tiny.config.num_hidden_layers))

    def run() -> tuple[torch.Tensor, torch.Tensor, dict]:
        scores = key_removal_gradient(tiny, ids, targets, False, sources=sources, presence=presence)
        with ExitStack() as stack:
            stack.enter_context(bias_keys(tiny, bias.clone().requires_grad_()))
            stack.enter_context(frozen_parameters(tiny))
            cache = stack.enter_context(trace(tiny, rows=targets - 1, layers=layers, grad=True))
            logits = tiny(input_ids=ids, use_cache=False).logits
            logits[0, targets - 1].log_softmax(-1).gather(-1, ids[0, targets, None]).sum().backward()
        return scores, logits.detach(), dict(cache)

    calls = []
    with monkeypatch.context() as patched:
        on_flex(patched, calls)
        fast, fast_logits, fast_cache = run()
    assert len(calls) >= 2 * tiny.config.num_hidden_layers  # each pass, every layer on FlexAttention
    with monkeypatch.context() as patched:
        patched.setattr(attention, "fused_key_bias", lambda *args: None)
        slow, slow_logits, slow_cache = run()
    close(fast, slow)
    close(fast_logits, slow_logits)
    assert fast_cache.keys() == slow_cache.keys()
    for name, captured in slow_cache.items():
        close(fast_cache[name], captured)


def test_the_fused_kernel_is_flash_on_cpu_flex_on_cuda_else_the_math_kernel(tiny):
    """One bias over plain logits: the flash kernel on CPU, FlexAttention on CUDA, the math kernel on
    other devices (the virtual one), under soft-capping or sinks, and with two biases; the planner's
    term on FlexAttention is the block mask's."""
    one, two = [KeyBias(torch.zeros(1, 8))], [KeyBias(torch.zeros(1, 8)), KeyBias(torch.zeros(1, 8))]
    assert fused_key_bias(one, "cpu", True) == FLASH
    assert fused_key_bias(one, torch.device("cuda", 1), True) == FLEX
    assert fused_key_bias(one, "vgpu", True) is None and fused_key_bias(one, "meta", True) is None
    assert fused_key_bias(one, "cuda", False) is None and fused_key_bias(two, "cuda", True) is None
    bias = torch.zeros(1, 100, requires_grad=True)
    shapes = Shapes.of(tiny)
    cuda = replace(shapes, device="cuda")
    planned = KeyBias(bias).memory(cuda, 100, 2, False, [KeyBias(bias)])
    assert planned == {"key_bias": 2 * BLOCK_MASK_BYTES * 100**2}
    assert not KeyBias(bias).masks_every_layer(cuda, [KeyBias(bias)])
