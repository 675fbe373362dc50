"""Shared fixtures: tiny random models for exactness tests, cached real models for the few real checks."""

import pytest
import torch

import probe

torch.set_num_threads(2)


@pytest.fixture(params=["llama", "gemma3"])
def tiny(request):
    """A tiny random model: Llama-style with GQA, or Gemma-3-style with sliding-window layers."""
    return probe.tiny_model(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (converted once to the user cache)."""
    return probe.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory):
    """A tiny random Llama saved with the real SmolLM2 tokenizer: loads by path like a real model, fast."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(probe.models.converted_folder("smollm2-135m"))
    folder = tmp_path_factory.mktemp("tiny-llama")
    probe.tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
