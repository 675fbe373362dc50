"""The in-context classification task of the position-bias study (vectors, not text)."""

from __future__ import annotations

import pytest
import torch

from probe.tasks.classification import Config, InContextClassification


def test_sequence_layout_and_targets():
    task = InContextClassification(seed=0)
    batch = task.batch(64)
    assert batch.inputs.shape == (64, 17, 64) and batch.targets.shape == (64,)
    labels = task.label_vectors
    # Label tokens are label vectors; the target is the label at the answer position.
    label_ids = (batch.inputs[:, 1::2, None] - labels).norm(dim=-1).argmin(dim=-1)  # [64, 8]
    assert torch.allclose(batch.inputs[:, 1::2], labels[label_ids])
    assert batch.targets.equal(label_ids.gather(1, batch.answer_position[:, None])[:, 0])
    # Burstiness 4 with 8 items: two classes, each labelled 4 times (unless both share a label).
    counts = torch.stack([label_ids.eq(label_ids[:, :1]).sum(1), label_ids.eq(batch.targets[:, None]).sum(1)])
    assert ((counts == 4) | (counts == 8)).all()
    # Vectors have variance 1 / dim (the paper's text).
    assert task.class_means.var().item() == pytest.approx(1 / 64, rel=0.05)


def test_answer_positions_bias_and_determinism():
    batch = InContextClassification(seed=1).batch(50, answer_positions=[0, 7])
    assert set(batch.answer_position.tolist()) == {0, 7}
    again = InContextClassification(seed=1).batch(50, answer_positions=[0, 7])
    assert again.inputs.equal(batch.inputs) and again.targets.equal(batch.targets)


@pytest.mark.parametrize(("answer", "copy"), [(0, 4), (4, 0), (0, 7), (7, 0), (4, 7), (7, 4)])
def test_test_sets_copy_the_answer_item(answer, copy):
    task = InContextClassification(seed=2)
    batch = task.test_batch(32, answer, copy)
    assert batch.inputs[:, 2 * copy].equal(batch.inputs[:, 2 * answer])
    assert (batch.answer_position == answer).all()
    # Novel classes: the items are not near any training class mean.
    nearest = torch.cdist(batch.inputs[:, 2 * answer], task.class_means).min(dim=1).values
    assert (nearest > 0.3).all()


def test_fixed_vocabulary_and_bad_config():
    task = InContextClassification(Config(fixed_vocabulary=0.75), seed=0)
    batch = task.batch(8)
    assert batch.inputs.shape == (8, 17, 64)
    with pytest.raises(ValueError, match="multiple of burstiness"):
        InContextClassification(Config(pairs=6, burstiness=4))
    with pytest.raises(ValueError, match="two different items"):
        task.test_batch(4, 3, 3)
