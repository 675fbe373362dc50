"""The development analysis's direct effects (``analyses.faithful_default.direct_effects``) against eager
forwards whose explicit masks hide each source's keys from the rows after the last source only, built by
hand (tests/reference.py); and the candidate that measures its top sources exactly. Tiny Llama and Gemma 3
(``model``, ``sample``: tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from reference import COMPACT_ATOL, eager_answer_logprob

from analyses.faithful_default import DIRECT, candidates, direct_effects
from probe import faithfulness


def test_direct_effects_equal_eager_passes_that_hide_each_source_from_the_rows_after_the_context(
    model, sample
):
    effects = direct_effects(model, sample)
    first = max(source.end for source in sample.sources)
    full = eager_answer_logprob(model, sample, [])
    assert effects.shape == (len(sample.sources),)
    for index, source in enumerate(sample.sources):
        knocked = eager_answer_logprob(model, sample, range(source.start, source.end), hidden_from=first)
        assert float(effects[index]) == pytest.approx(full - knocked, abs=COMPACT_ATOL)
    # the rows after the context see less than a removal hides: not leave-one-out's drop in general
    first_source = range(sample.sources[0].start, sample.sources[0].end)
    removed = full - eager_answer_logprob(model, sample, first_source)
    assert float(effects[0]) != pytest.approx(removed, abs=1e-6)


def test_the_candidate_measures_the_top_of_the_direct_effects_and_keeps_the_rest():
    generator = torch.Generator().manual_seed(0)
    kept, actual = torch.rand(8, 4, generator=generator) > 0.5, torch.randn(8, generator=generator)
    measured = {
        "drops": torch.tensor([0.2, 5.0, 1.0, 0.1]), "kept": kept, "actual": actual, "removal": 0.5,
        "rankings": {DIRECT: torch.tensor([0.5, 0.4, 0.3, 0.0])}, "costs": {DIRECT: 2.0},
    }  # fmt: skip
    rows = {row["scorer"]: row for row in candidates({"task": "kv", "seed": 7000}, measured)}
    one, two = rows[f"{DIRECT} measure 1"], rows[f"{DIRECT} measure 2"]
    assert one["lds"] == faithfulness.lds(torch.tensor([0.2, 0.4, 0.3, 0.0]), kept, actual)
    assert two["lds"] == faithfulness.lds(torch.tensor([0.2, 5.0, 0.3, 0.0]), kept, actual)
    assert not one["top_source_found"] and two["top_source_found"]  # the top drop is its second
    assert two["cost"] == 2.0 + 3 * 0.5  # two removals and the head check after the direct pass
