"""The public API with the model on another device, as a user runs it: the model moved there, every
tensor the user makes left on the CPU (the default device). Each result equals the CPU model's.

``pytest --device cuda`` runs it on the GPU. On the CPU the other device is ``vgpu``
(:mod:`virtual_device`): CPU memory that reports another device and refuses what CUDA refuses (mixed
devices, ``.numpy()``), so a device mistake fails here too.
"""

from __future__ import annotations

import contextlib

import pandas as pd
import pytest
import torch
from reference import head_weights_for
from transformers import AutoTokenizer
from virtual_device import virtual_device

import probe
from probe import detectors, faithfulness, metrics, tasks
from probe.models import converted_folder
from probe.target import AnswerToken, Contrast

# Detectors whose settings would make a test of minutes; their passes are the ones tested here.
SLOW = {"integrated_gradients": {"n_steps": 4}, "context_cite": {"n_masks": 8}, "lsd": {"K": 64, "d": 16}}
SHARED = ["attention", "information_flow", "embedding_grad"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))


@pytest.fixture(scope="module")
def on_device(request):
    """(device, a context manager under which it exists, tolerance): the virtual device on the CPU
    (the same kernels: equal to 1e-4), a GPU (other kernels, other summation orders: 5e-3)."""
    device = request.config.getoption("--device")
    return ("vgpu", virtual_device, 1e-4) if device == "cpu" else (device, contextlib.nullcontext, 5e-3)


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen2"])
def models(request, tokenizer, on_device):
    """The same tiny model twice, on the CPU and on the device under test; the context; the tolerance."""
    device, context, atol = on_device
    model = probe.tiny_model(request.param, vocab_size=len(tokenizer), max_position_embeddings=1024)
    with context():
        moved = probe.tiny_model(request.param, vocab_size=len(tokenizer), max_position_embeddings=1024)
        moved.load_state_dict(model.state_dict())
        moved.to(device)
    return model, moved, context, atol


@pytest.fixture(scope="module")
def sample(tokenizer):
    return tasks.make("multihop-2", tokenizer, 200, seed=3)


def traced(model, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Layer 1's attention rows at ``targets``, through :func:`probe.trace`, on the CPU."""
    with probe.trace(model, rows=targets, layers=[1]) as cache:
        model(ids[None].to(model.device))
    return cache["blocks.1.attn.hook_pattern"].cpu()


def close(found, expected, atol: float) -> None:
    if torch.is_tensor(expected):
        assert found.device.type == "cpu", "results come back on the CPU"
        torch.testing.assert_close(found, expected, atol=atol, rtol=1e-3, equal_nan=True)
    elif isinstance(expected, float):
        assert found == pytest.approx(expected, abs=atol, rel=1e-3, nan_ok=True)


@pytest.mark.parametrize("name", detectors.names())
def test_every_detector_on_the_device_equals_the_cpu(models, tokenizer, sample, name):
    model, moved, context, atol = models
    options = SLOW.get(name, {})
    if name == "at2":
        options = {"weights": head_weights_for(model)}
    expected = detectors.detect(name, model, tokenizer, sample, **options)
    with context():
        found = detectors.detect(name, moved, tokenizer, sample, **options)
        scores = metrics.plausibility(found, sample)
        frame = found.to_frame(tokenizer, sample)
        html = found._view(sample)
    if name == "fr" and atol > 1e-4:
        # counts of top-k memberships in a random model's near-uniform attention: another kernel's
        # rounding flips near ties (the attention it counts is compared through `attention`)
        return
    close(found.scores, expected.scores, atol)
    assert torch.equal(found.flagged, expected.flagged)
    for key, value in metrics.plausibility(expected, sample).items():
        close(scores[key], value, atol)
    pd.testing.assert_frame_equal(frame, expected.to_frame(tokenizer, sample), atol=atol, rtol=1e-3)
    assert html.count("<span") >= len(sample.input_ids)  # the view renders every token


def test_shared_pass_batches_faithfulness_and_the_probes_on_the_device(models, tokenizer, sample):
    model, moved, context, atol = models
    ids, targets = sample.input_ids, sample.target_positions
    scores = {"recency": detectors.detect("recency", model, tokenizer, sample).source_scores(sample)}
    judged = faithfulness.Judgement(ks=[1, 2], n_masks=4)

    def run(model) -> dict:
        """Each probe's result on the CPU (tensors of the model's device moved back, as a user would)."""
        with probe.ablate_heads(model, [(0, 0)]), probe.mask_keys(model, torch.arange(5, 20)):
            ablated = model(ids[None].to(model.device)).logits[0, -1].cpu()
        return {
            "many": detectors.detect_many(SHARED, model, tokenizer, [sample, sample]),
            "flow": probe.information_flow(model, ids, targets).cpu(),
            "trace": traced(model, ids, targets),
            "faithfulness": faithfulness.evaluate(model, sample, scores, judged),
            "masked": faithfulness.evaluate(
                model, sample, scores, judged, faithfulness.Passes(compact=False)
            ),
            "ablated": ablated,
        }

    expected = run(model)
    with context():
        found = run(moved)
    for one, other in zip(found.pop("many"), expected.pop("many"), strict=True):
        for name in one:
            close(one[name].scores, other[name].scores, atol)
    for name in ("faithfulness", "masked"):
        frames = found.pop(name), expected.pop(name)
        numbers = frames[1].select_dtypes("number").columns
        pd.testing.assert_frame_equal(*(frame[numbers] for frame in frames), atol=atol, rtol=1e-3)
    for name, value in expected.items():
        close(found[name], value, atol)


def test_attribute_and_answer_on_the_device(models, tokenizer):
    model, moved, context, atol = models
    text = "The lighthouse keeper was named Ada. The ferry left at noon. Ada painted the door blue."
    query = "Who kept the lighthouse?"
    expected = probe.attribute(model, tokenizer, text, query, detector="information_flow")
    with context():
        found = probe.attribute(moved, tokenizer, text, query, detector="information_flow")
        frame = found.to_frame()
    assert found.sample.answer == expected.sample.answer
    close(found.scores, expected.scores, atol)
    assert frame.text.tolist() == expected.to_frame().text.tolist()


def test_the_virtual_device_refuses_what_a_gpu_refuses(request):
    """The check itself: each of these mistakes passes on the CPU alone and fails on a GPU."""
    if request.config.getoption("--device") != "cpu":
        pytest.skip("the virtual device is the CPU suite's; with a GPU the tests above use the GPU")
    with virtual_device() as device:
        on_device = torch.ones(3, device=device)
        mistakes = {
            "a CPU operand": lambda: on_device + torch.ones(3),
            "CPU input to a model layer": lambda: torch.nn.Linear(3, 1).to(device)(torch.ones(3)),
            "a CPU tensor indexed by device indices": lambda: torch.ones(3)[torch.tensor([0], device=device)],
            "numpy": lambda: on_device.numpy(),
        }
        for mistake, run in mistakes.items():
            with pytest.raises((RuntimeError, TypeError), match="device"):
                run()
                pytest.fail(f"not refused: {mistake}")
        assert (on_device + 1).device.type == device and (on_device + torch.tensor(1.0)).device.type == device
        assert on_device[torch.tensor([0, 2])].tolist() == [1.0, 1.0] and on_device.cpu().device.type == "cpu"


def test_the_other_probes_on_the_device(models, tokenizer, sample):
    """context_selector, LongPPL's LSD, retrieval scores and noise restraint: results equal the CPU's."""
    model, moved, context, atol = models
    needle = tasks.make("niah", tokenizer, 200, seed=0)
    text = sample.text[:400]

    def run(model) -> dict:
        return {
            "selector": probe.context_selector(model, sample.input_ids, layers=[-1]).cpu(),
            "lsd": probe.token_lsd(model, tokenizer, text, K=32, d=16),
            "retrieval": probe.retrieval_scores(model, tokenizer, [needle], require_correct=False).to_frame(),
            "restraint": probe.noise_restraint(model, sample, lr=[0.0, 0.1]),
        }

    expected = run(model)
    with context():
        found = run(moved)
    close(found["selector"], expected["selector"], atol)
    for name in ("lsd", "retrieval", "restraint"):
        numbers = expected[name].select_dtypes("number").columns
        pd.testing.assert_frame_equal(found[name][numbers], expected[name][numbers], atol=atol, rtol=1e-3)


def test_targets_on_the_device(models, tokenizer, sample):
    """A contrast and one answer token as ``target=``: gradient detectors and ablations equal the CPU's."""
    model, moved, context, atol = models
    answer = sample.input_ids[sample.target_positions]
    targets = [Contrast((answer + 1) % len(tokenizer)), AnswerToken(-1)]
    removed = torch.tensor([[False] * len(sample.sources), [True] + [False] * (len(sample.sources) - 1)])

    def run(model) -> list:
        return [
            (
                detectors.detect("information_flow", model, tokenizer, sample, target=target).scores,
                detectors.detect("key_removal_banzhaf", model, tokenizer, sample, target=target).scores,
                faithfulness.answer_scores(
                    model, sample, removed, faithfulness.Passes(target=target)
                ).logprob,
            )
            for target in targets
        ]

    expected = run(model)
    with context():
        found = run(moved)
    for ours, theirs in zip(found, expected, strict=True):
        for one, other in zip(ours, theirs, strict=True):
            close(one, other, atol)
