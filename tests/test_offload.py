"""Probes on models dispatched by accelerate (offloaded to CPU or disk): the plain model's results."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import cpu_offload, disk_offload

import probe
from probe import faithfulness
from probe.memory import planner

IDS = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
TARGETS = [30, 39]
PROBES = {
    "attention_rows": lambda m: probe.attention_rows(m, IDS, [5, 39]),
    "information_flow": lambda m: probe.information_flow(m, IDS, TARGETS),
    "information_flow checkpointed": lambda m: probe.information_flow(m, IDS, TARGETS, checkpoint=True),
    "embedding_grads": lambda m: probe.embedding_grads(m, IDS, TARGETS),
    "batched information_flow": lambda m: torch.cat(
        [f.flatten() for f in probe.information_flow(m, [IDS, IDS[:25]], [TARGETS, [24]])]
    ),
    "key masking": lambda m: _masked_logits(m),
}


def _masked_logits(model):
    with probe.mask_keys(model, [3, 4, 20]), torch.no_grad():
        return model(input_ids=IDS[None].to(probe.checks.input_device(model))).logits


@pytest.fixture(params=["cpu_offload", "disk_offload"])
def offloaded(request, tiny, tmp_path):
    """(plain model, the same weights offloaded by accelerate; compute on the CPU)."""
    copy_ = copy.deepcopy(tiny)
    if request.param == "cpu_offload":
        return tiny, cpu_offload(copy_, execution_device=torch.device("cpu"))
    return tiny, disk_offload(copy_, tmp_path / "weights", execution_device=torch.device("cpu"))


@pytest.mark.parametrize("name", PROBES)
def test_offloaded_models_give_the_plain_results(offloaded, name):
    plain, offloaded_model = offloaded
    assert next(offloaded_model.parameters()).device.type == "meta"  # the weights really are elsewhere
    assert torch.equal(PROBES[name](offloaded_model), PROBES[name](plain))


def test_the_planner_plans_for_the_execution_device(offloaded):
    plain, offloaded_model = offloaded
    assert planner.Shapes.of(offloaded_model) == planner.Shapes.of(plain)
    assert planner._device_of(offloaded_model) == "cpu"


def test_ablation_scores_on_an_offloaded_model(offloaded):
    plain, offloaded_model = offloaded
    sample = _hand_sample()
    removed = torch.tensor([[False, False], [True, False], [False, True]])
    expected = faithfulness.answer_scores(plain, sample, removed)
    got = faithfulness.answer_scores(offloaded_model, sample, removed)
    assert torch.equal(got.logprob, expected.logprob)


def _hand_sample():
    import numpy as np

    from probe.tasks import Sample

    spans = {"supporting": [(5, 9)], "noise": [(12, 20)], "question": [(25, 30)], "answer": [(36, 39)]}
    return Sample(
        task="hand", length=39, seed=0, depth=None, options={}, text="", input_ids=IDS[:39], answer="",
        answer_pattern="", prompt_length=36, spans=spans, char_spans={},
        offsets=np.zeros((39, 2), dtype=np.int64),
    )  # fmt: skip
