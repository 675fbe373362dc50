"""AttnLRP against an independent reference: the same rules written as detach tricks inside eager
attention and hand-patched norm / MLP forwards (the form of the paper's appendix), on tiny Llama and
Gemma 3; hooks removed afterwards; unsupported blocks refused."""

import pytest
import torch
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama

import probe
from probe.probes.lrp import lrp_rules, relevance

SEQ = 20
TARGETS = torch.tensor([18, 19])


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x in value, factor · ∂ in gradient."""
    return factor * x + (1 - factor) * x.detach()


def reference_relevance(model, ids, targets, monkeypatch) -> torch.Tensor:
    """e · ∂(Σ answer logits)/∂e with every rule written out by hand in eager attention."""
    module = modeling_llama if model.config.model_type == "llama" else modeling_gemma3
    eager = module.eager_attention_forward

    def attention(mod, query, key, value, *args, **kwargs):
        return eager(mod, scaled(query, 0.25), scaled(key, 0.25), scaled(value, 0.5), *args, **kwargs)

    def norm(self, x):
        y = self._original(x)
        return x * (y / x).detach()

    def mlp(self, x):
        gate = self.gate_proj(x)
        activated = gate * (self.act_fn(gate) / gate).detach()
        return self.down_proj(scaled(activated * self.up_proj(x), 0.5))

    monkeypatch.setattr(module, "eager_attention_forward", attention)
    for sub in model.modules():
        if type(sub).__name__.endswith("RMSNorm"):
            monkeypatch.setattr(sub, "_original", sub.forward, raising=False)
            monkeypatch.setattr(sub, "forward", norm.__get__(sub))
        elif type(sub).__name__.endswith("MLP"):
            monkeypatch.setattr(sub, "forward", mlp.__get__(sub))
    original = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds, use_cache=False).logits[0, targets - 1]
        logits.gather(-1, ids[0, targets, None]).sum().backward()
    finally:
        model.set_attn_implementation(original)
    return (embeds * embeds.grad).sum(-1)[0].detach()


@pytest.mark.parametrize("checkpoint", [False, True])
def test_relevance_equals_the_hand_written_rules(tiny, monkeypatch, checkpoint):
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(0))
    got = relevance(tiny, ids, TARGETS, checkpoint=checkpoint)
    plain = tiny.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = tiny(inputs_embeds=plain, use_cache=False).logits[0, TARGETS - 1]
    logits.gather(-1, ids[0, TARGETS, None]).sum().backward()
    gradient_times_input = (plain * plain.grad).sum(-1)[0]
    with monkeypatch.context() as patch:
        expected = reference_relevance(tiny, ids, TARGETS, patch)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)
    assert (got - gradient_times_input).abs().max() > 1e-3  # the rules change the backward pass
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in tiny.modules())  # hooks removed


def test_forward_is_unchanged_and_unsupported_blocks_are_refused(tiny):
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = tiny(input_ids=ids).logits
        with lrp_rules(tiny):
            ruled = tiny(input_ids=ids).logits
    assert torch.allclose(plain, ruled, atol=1e-6)
    from test_architectures import build

    with pytest.raises(probe.UnsupportedModelError, match="gated MLP"):
        relevance(build("GPT-2"), ids, TARGETS)
