"""Activation patching of heads (probe.attention.patching) against a hand-built reference: eager attention
with
forward hooks on the output projection that record its input and splice recorded head slices back in;
and the modifier protocol itself, through a new modifier written in a few lines."""

from dataclasses import dataclass, replace

import pytest
import torch
from reference import explicit_masks

import probe
from probe.attention import OUTPUTS, Modifier, modify
from probe.attention.modifiers import KeyBias
from probe.memory.planner import plan
from probe.shapes import Shapes

ATOL = 1e-5
SEQ = 24  # longer than the tiny Gemma's sliding window (6)
HEADS = [(0, 1), (1, 0), (2, 1)]


def random_ids(model, seed: int, seq: int = SEQ) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, seq), generator=generator)


def head_dim(model) -> int:
    config = model.config.get_text_config()
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def o_projs(model):
    return [layer.self_attn.o_proj for layer in model.model.layers]


def eager(model, ids, hooks, mask=None) -> torch.Tensor:
    """Eager logits with ``hooks`` {layer: forward pre-hook of its o_proj} and an explicit ``mask``."""
    handles = [o_projs(model)[layer].register_forward_pre_hook(hook) for layer, hook in hooks.items()]
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        model.set_attn_implementation("sdpa")
        for handle in handles:
            handle.remove()


def eager_recorded(model, ids, mask=None) -> list[torch.Tensor]:
    """o_proj's input of every layer in an eager forward, as [1, seq, heads, head_dim]."""
    recorded = {}
    hooks = {
        layer: (lambda _, args, layer=layer: recorded.__setitem__(layer, args[0].detach()))
        for layer in range(len(o_projs(model)))
    }
    eager(model, ids, hooks, mask)
    return [recorded[layer].unflatten(-1, (-1, head_dim(model))) for layer in sorted(recorded)]


def eager_patched(model, ids, source: list[torch.Tensor], heads, mask=None) -> torch.Tensor:
    """Eager logits with each (layer, head)'s slice of o_proj's input replaced by ``source``'s."""
    d, by_layer = head_dim(model), {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)

    def splice(_, args, layer):
        x = args[0].clone()
        for head in by_layer[layer]:
            x[..., head * d : (head + 1) * d] = source[layer][..., head, :]
        return (x,)

    hooks = {layer: (lambda m, args, layer=layer: splice(m, args, layer)) for layer in by_layer}
    return eager(model, ids, hooks, mask)


def test_record_heads_equals_the_output_projection_input(tiny):
    ids = random_ids(tiny, 0)
    expected = eager_recorded(tiny, ids)
    with torch.no_grad(), probe.record_heads(tiny) as cache:
        tiny(input_ids=ids, use_cache=False)
    assert len(cache) == len(expected)
    for layer, z in enumerate(expected):
        assert cache["z", layer].shape == z.shape
        assert (cache["z", layer] - z).abs().max() <= ATOL
    with torch.no_grad(), probe.record_heads(tiny, layers=[-1]) as last:
        tiny(input_ids=ids, use_cache=False)
    assert list(last) == [f"blocks.{len(expected) - 1}.attn.hook_z"]


def test_patch_heads_equals_the_hand_built_reference(tiny):
    clean, corrupt = random_ids(tiny, 0), random_ids(tiny, 1)
    source = eager_recorded(tiny, clean)
    expected = eager_patched(tiny, corrupt, source, HEADS)
    with torch.no_grad(), probe.record_heads(tiny) as cache:
        tiny(input_ids=clean, use_cache=False)
    with torch.no_grad(), probe.patch_heads(tiny, cache, HEADS):
        patched = tiny(input_ids=corrupt, use_cache=False).logits
    with torch.no_grad():
        plain = tiny(input_ids=corrupt, use_cache=False).logits
    assert (patched - expected).abs().max() <= ATOL
    assert (patched - plain).abs().max() > 1e-3  # the patch changed something
    n_heads = tiny.config.num_attention_heads
    every_head = [(layer, head) for layer in range(len(source)) for head in range(n_heads)]
    with torch.no_grad(), probe.patch_heads(tiny, cache, every_head):
        all_patched = tiny(input_ids=corrupt, use_cache=False).logits
    assert (all_patched - eager_patched(tiny, corrupt, source, every_head)).abs().max() <= ATOL
    assert tiny.config._attn_implementation == "sdpa"


def test_patch_heads_nests_with_other_modifiers_and_checkpointing(tiny):
    """Inside a key mask the patched forward equals the hand-built reference under the explicit mask,
    and a record inside the patch sees the patched heads; a patched, checkpointed pass has the plain
    one's gradient."""
    clean, corrupt = random_ids(tiny, 0), random_ids(tiny, 1)
    hidden = [2, 5, 9]
    masks = explicit_masks(tiny, SEQ, hidden)
    mask = masks if len(masks) > 1 else next(iter(masks.values()))
    expected = eager_patched(tiny, corrupt, eager_recorded(tiny, clean, mask), HEADS, mask)
    with torch.no_grad(), probe.mask_keys(tiny, hidden):
        with probe.record_heads(tiny) as source:
            tiny(input_ids=clean, use_cache=False)
        with probe.record_heads(tiny) as seen, probe.patch_heads(tiny, source, HEADS):
            got = tiny(input_ids=corrupt, use_cache=False).logits
    assert (got - expected).abs().max() <= ATOL
    for layer, head in HEADS:
        assert (seen["z", layer][..., head, :] - source["z", layer][..., head, :]).abs().max() == 0
    targets = torch.tensor([SEQ - 1])
    with probe.patch_heads(tiny, source, HEADS):
        plain = probe.embedding_grads(tiny, corrupt, targets, checkpoint=False)
        checkpointed = probe.embedding_grads(tiny, corrupt, targets, checkpoint=True)
    assert (plain - checkpointed).abs().max() <= 1e-6


def test_patch_heads_refuses_a_wrong_source_before_running(tiny):
    with torch.no_grad(), probe.record_heads(tiny, layers=[0]) as cache:
        tiny(input_ids=random_ids(tiny, 0), use_cache=False)
    with pytest.raises(KeyError, match="record the source run"):
        with probe.patch_heads(tiny, cache, [(1, 0)]):
            pass
    with pytest.raises(TypeError, match="ActivationCache"):
        with probe.patch_heads(tiny, {}, [(0, 0)]):
            pass
    with pytest.raises(IndexError, match="head 99"):
        with probe.patch_heads(tiny, cache, [(0, 99)]):
            pass
    with pytest.raises(ValueError, match="same number of tokens"):
        with torch.no_grad(), probe.patch_heads(tiny, cache, [(0, 0)]):
            tiny(input_ids=random_ids(tiny, 0, seq=SEQ - 3), use_cache=False)
    assert tiny.config._attn_implementation == "sdpa"


@dataclass(eq=False)
class DoubleHeads(Modifier):
    """A new output modifier in a few lines: every head's output times two."""

    changes = frozenset({OUTPUTS})

    def outputs(self, output, call):
        return output * 2


def test_a_new_modifier_is_one_subclass_and_nests(tiny):
    """The protocol: a subclass with one hook acts in every layer, and its stage orders it after the
    rows a trace with grad=True rebuilds as A·V."""
    ids = random_ids(tiny, 0)
    source = eager_recorded(tiny, ids)
    doubled = {layer: (lambda _, args: (args[0] * 2,)) for layer in range(len(source))}
    expected = eager(tiny, ids, doubled)
    with (
        torch.enable_grad(),
        modify(tiny, DoubleHeads()) as modifier,
        probe.trace(tiny, rows=[SEQ - 1], grad=True),
    ):
        got = tiny(input_ids=ids, use_cache=False).logits.detach()
    assert (got - expected).abs().max() <= 1e-4
    assert modifier.layers_seen == set(range(len(source)))
    tiny.zero_grad(set_to_none=True)


def test_the_planner_asks_the_active_modifiers(tiny):
    """A key bias with a gradient states its memory and plan() adds it to every phase: on CPU the
    flash kernel's masks of the running layer, on a device without a fused key bias (XPU) the math
    kernel's attention matrices (CUDA's FlexAttention: tests/test_flex_key_bias.py)."""
    n = 64
    bias = torch.zeros(1, n, requires_grad=True)
    flash = plan(tiny, n, "embedding_grads", modifiers=[KeyBias(bias)])
    assert flash.terms["key_bias"] == 2 * n * n * 4 + n * n
    assert flash.terms["masks"] == plan(tiny, n, "embedding_grads").terms["masks"]  # no mask per layer
    other = replace(Shapes.of(tiny), device="xpu")
    plain = plan(other, n, "embedding_grads")
    biased = plan(other, n, "embedding_grads", modifiers=[KeyBias(bias)])
    config = tiny.config
    per_layer = 2 * config.num_attention_heads * n * n * 4 + n * n
    expected = config.num_hidden_layers * per_layer + 8 * config.num_attention_heads * n * n
    assert biased.terms["key_bias"] == expected
    assert biased.terms["masks"] > plain.terms["masks"]  # every layer now gets a mask
    checkpointed = plan(other, n, "embedding_grads", checkpoint=True, modifiers=[KeyBias(bias)])
    assert checkpointed.terms["key_bias"] == per_layer + 8 * config.num_attention_heads * n * n
    beside_outputs = plan(tiny, n, "embedding_grads", modifiers=[KeyBias(bias), DoubleHeads()])
    assert beside_outputs.terms["key_bias"] == flash.terms["key_bias"]  # still on the flash kernel
    assert "key_bias" not in plan(tiny, n, "embedding_grads", modifiers=[KeyBias(bias.detach())]).terms
