"""Every Hugging Face causal LM whose attention runs through the AttentionInterface works unchanged:
tiny random models of many architectures, attention rows and information flow against eager
attention (``output_attentions`` and ``retain_grad``), soft-capping and sink logits included.

The README's list of supported architectures is generated from ``ARCHITECTURES`` (see the last test).
"""

import inspect
from pathlib import Path

import pytest
import torch
import transformers
from reference import information_flow_reference

import probe

ATOL = 1e-5
SEQ = 20
SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=2,
    max_position_embeddings=512,
)
MOE = dict(num_experts_per_tok=2)
SLIDING = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])

# name in the README -> (transformers config class, settings beyond SMALL)
ARCHITECTURES = {
    "Llama": ("LlamaConfig", {}),
    "Mistral": ("MistralConfig", {"sliding_window": 6}),
    "Ministral": ("MinistralConfig", {"sliding_window": 6}),
    "Mixtral": ("MixtralConfig", MOE | {"num_local_experts": 4}),
    "Qwen2": ("Qwen2Config", {}),
    "Qwen2-MoE": (
        "Qwen2MoeConfig",
        MOE | {"num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
    ),
    "Qwen3": ("Qwen3Config", {}),
    "Qwen3-MoE": ("Qwen3MoeConfig", MOE | {"num_experts": 4, "moe_intermediate_size": 16}),
    "Phi": ("PhiConfig", {"num_key_value_heads": 4}),
    "Phi-3": ("Phi3Config", {"pad_token_id": 0}),
    "Gemma": ("GemmaConfig", {}),
    "Gemma 2 (logit soft-capping)": (
        "Gemma2Config",
        SLIDING | {"attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 8},
    ),
    "Gemma 3": ("Gemma3TextConfig", SLIDING | {"query_pre_attn_scalar": 8}),
    "OLMo": ("OlmoConfig", {}),
    "OLMo 2": ("Olmo2Config", {}),
    "OLMoE": ("OlmoeConfig", MOE | {"num_experts": 4}),
    "Cohere": ("CohereConfig", {}),
    "StableLM": ("StableLmConfig", {}),
    "Granite": ("GraniteConfig", {}),
    "Granite-MoE": ("GraniteMoeConfig", MOE | {"num_local_experts": 4}),
    "Starcoder2": ("Starcoder2Config", {}),
    "GPT-NeoX": ("GPTNeoXConfig", {"num_key_value_heads": 4}),
    "GPT-2": ("GPT2Config", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 512}),
    "SmolLM3": ("SmolLM3Config", {"pad_token_id": 0}),
    "GLM": ("GlmConfig", {"pad_token_id": 0}),
    "Helium": ("HeliumConfig", {}),
    "Seed-OSS": ("SeedOssConfig", {}),
    "EXAONE 4": ("Exaone4Config", {"sliding_window": 6}),
    "gpt-oss (sink logits)": ("GptOssConfig", SLIDING | MOE | {"num_local_experts": 4}),
}
# transformers refuses sdpa for these two (it cannot soft-cap or add sinks); longprobe models both.
EAGER_BY_DEFAULT = {"Gemma2Config", "GptOssConfig"}


def build(name: str) -> transformers.PreTrainedModel:
    """A tiny random model of architecture ``name``, q/k weights scaled so attention is sharp."""
    config_class, settings = ARCHITECTURES[name]
    config_type = getattr(transformers, config_class)
    known = set(inspect.signature(config_type.__init__).parameters) | set(config_type.attribute_map)
    small = {key: value for key, value in SMALL.items() if key in known}  # the config's own fields only
    config = config_type(**(small | settings))
    config._attn_implementation = "eager" if config_class in EAGER_BY_DEFAULT else "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    sharpened = ("q_proj.weight", "k_proj.weight", "c_attn.weight", "query_key_value.weight")
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(sharpened):
                param.mul_(4.0)
    return model


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_attention_rows_and_information_flow_match_eager(name):
    model = build(name)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    rows = [0, 7, SEQ - 1]
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    model.set_attn_implementation(implementation)
    expected_rows = torch.stack([a[0][:, rows] for a in attentions])
    got_rows = probe.attention_rows(model, ids, rows)
    assert (got_rows - expected_rows).abs().max() <= ATOL

    targets = torch.tensor([9, SEQ - 1])
    expected_flow = information_flow_reference(model, ids, targets)
    got_flow = probe.information_flow(model, ids, targets)
    assert expected_flow.abs().max() > 1e-4  # not a comparison of zeros
    assert (got_flow - expected_flow).abs().max() <= ATOL * max(1.0, expected_flow.abs().max())
    assert model.config._attn_implementation == implementation


def test_soft_capping_and_sinks_are_modelled_not_ignored():
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    gemma2 = build("Gemma 2 (logit soft-capping)")
    capped = probe.attention_rows(gemma2, ids, [SEQ - 1])
    for layer in gemma2.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert (probe.attention_rows(gemma2, ids, [SEQ - 1]) - capped).abs().max() > 1e-3
    sinks = probe.attention_rows(build("gpt-oss (sink logits)"), ids, [SEQ - 1])
    assert sinks.sum(-1).min() < 1 - 1e-3  # the sink column takes part of each row's mass


def supported_architectures_markdown() -> str:
    return ", ".join(ARCHITECTURES) + "."


def test_readme_lists_the_tested_architectures():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("<!-- architectures:start -->\n")[1].split("<!-- architectures:end -->")[0]
    assert block.strip() == supported_architectures_markdown(), (
        "README's architecture list differs from tests/test_architectures.py; paste:\n"
        + supported_architectures_markdown()
    )


def test_bidirectional_models_are_refused_before_any_work():
    """BERT attends to later tokens too (eager attention puts most of a row's mass there): causal rows
    read from it would be wrong, so every probe refuses it, naming the fix."""
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    rows = lambda: probe.attention_rows(model, ids, [3])  # noqa: E731
    flow = lambda: probe.information_flow(model, ids[0], [5])  # noqa: E731
    for run in (rows, flow):
        with pytest.raises(probe.UnsupportedModelError, match="both directions.*AutoModelForCausalLM"):
            run()
