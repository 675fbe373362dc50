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
