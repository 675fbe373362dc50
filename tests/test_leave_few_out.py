"""``leave_few_out``: the few sources it measures against an independent key-masked removal (an eager pass
with the keys hidden by hand), the rest against the key-removal gradient at presence ½, its choice against
a brute-force loop over the rankers' tops (each ranker computed on its own), its certificate in the
detection, its frame, its view and its saved file. Tiny Llama and Gemma 3 (``model``, ``sample``:
tests/conftest.py)."""

from __future__ import annotations

import html

import numpy as np
import pytest
import torch
from reference import COMPACT_ATOL, eager_answer_logprob

import probe
from probe import detectors, faithfulness
from probe.attention.modifiers import bias_keys
from probe.probes.attribution import information_flow
from probe.probes.key_removal import key_removal_gradient, removal_units


def hidden_tokens(sample, chosen) -> list[int]:
    return [t for i in chosen for t in range(sample.sources[i].start, sample.sources[i].end)]


def weighted_by_hand(model, sample) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([the key-removal gradient summed over each source, information flow averaged over it], the
    key-removal gradient by source), each from its own pass at presence ½: the gradient from
    ``key_removal_gradient`` (tested against eager autograd), the flow from ``information_flow`` under a
    hand-set key bias of log ½ on the sources."""
    spans = [(source.start, source.end) for source in sample.sources]
    ids, targets = sample.input_ids, sample.target_positions
    tokens = key_removal_gradient(model, ids, targets, sources=spans, presence=0.5)
    units = removal_units(spans, len(ids))
    start = torch.where(units >= len(ids), torch.tensor(0.5).log(), 0.0)
    with bias_keys(model, start[None], units):
        flow = information_flow(model, ids, targets).sum(0)
    slope = torch.stack([tokens[s.start : s.end].sum() for s in sample.sources])
    return [slope, torch.stack([flow[s.start : s.end].mean() for s in sample.sources])], slope


@pytest.mark.parametrize("measure", [1, 3])
def test_measured_drops_and_the_head_check_equal_key_masked_removals(model, sample, measure):
    found = probe.detect("leave_few_out", model, None, sample, measure=measure, check=2)
    details = found.details
    rankings, slope = weighted_by_hand(model, sample)
    chosen = []
    for ranking in rankings:  # the union of each ranker's top `measure`, ties to the earlier source
        order = sorted(range(len(ranking)), key=lambda i: (-float(ranking[i]), i))
        chosen += [i for i in order[:measure] if i not in chosen]
    assert details["measured"].nonzero().flatten().tolist() == sorted(chosen)
    full = eager_answer_logprob(model, sample, [])
    assert details["full_logprob"] == pytest.approx(full, abs=COMPACT_ATOL)
    scores = details["source_scores"]
    for i in chosen:
        drop = full - eager_answer_logprob(model, sample, hidden_tokens(sample, [i]))
        assert float(scores[i]) == pytest.approx(drop, abs=COMPACT_ATOL)
    head = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:2]
    assert details["head"].tolist() == head
    joint = full - eager_answer_logprob(model, sample, hidden_tokens(sample, head))
    assert details["head_drop"] == pytest.approx(joint, abs=COMPACT_ATOL)
    assert details["head_sum"] == pytest.approx(float(scores[head].sum()))
    rest = [i for i in range(len(scores)) if i not in chosen]
    np.testing.assert_allclose(
        scores.double().numpy()[rest], slope.double().numpy()[rest], rtol=1e-4, atol=1e-6
    )
    assert details["scale"] == 1.0 and "presence 0.5" in details["estimated_by"]
    assert details["passes"] == 1 + len(chosen) + 2  # the weighted pass, the removals, full and head
    assert torch.equal(found.scores[sample.sources[head[0]].start], scores[head[0]])


def test_the_certificate_is_in_the_frame_the_view_and_the_saved_file(model, sample, tmp_path):
    found = probe.detect("leave_few_out", model, None, sample)
    frame = found.to_frame(sample=sample, rows="source")
    assert frame.measured.tolist() == found.details["measured"].tolist()
    measured = found.details["measured"].nonzero().flatten().tolist()
    text = found.certificate()
    assert f"measured exactly: {len(measured)} of {len(sample.sources)} sources" in text
    assert (
        f"#{measured[0]} " in text
        and "removed together lose" in text
        and "key-removal gradient at presence 0.5" in text
    )
    assert html.escape(text) in found._view(sample)
    found.save(tmp_path / "found.json")
    assert detectors.Detection.load(tmp_path / "found.json").certificate() == text
    assert probe.detect("attention", model, None, sample).certificate() == ""


def test_the_judgement_reuses_its_passes_and_bad_options_are_refused(model, sample, passes):
    found = probe.detect("leave_few_out", model, None, sample)
    known = faithfulness.Ablations.of(found)
    assert len(known.removed) == found.details["passes"] - 1  # every masked pass, the shared one aside
    passes.kill_after(None)
    for options in ({"measure": 0}, {"check": True}, {"rank_by": ["leave_one_out"]}, {"rank_by": "nope"}):
        with pytest.raises(probe.LongprobeError):
            probe.detect("leave_few_out", model, None, sample, **options)
    assert passes.calls == 0  # refused before any masked pass


@pytest.mark.parametrize("seed", ["3", "5002", "7100", "8005"])
def test_development_refuses_the_seeds_of_the_studies_that_judge(seed, tmp_path, capsys):
    """``analyses.faithful_default`` develops on its own seeds: those of the held-out study, the HotpotQA
    study and the judged run are refused before any model loads."""
    from analyses import faithful_default

    with pytest.raises(SystemExit):
        faithful_default.main(["--model", "no-such-model", "--seeds", "7000", seed, "--out", str(tmp_path)])
    assert "not for development" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_development_rescored_from_its_saved_arrays_gives_the_same_rows_and_the_added_candidates():
    """``--rescore``: every committed development sample scored again from its saved measurements, no
    model run: the candidates scored before keep their numbers; the candidates added since get rows."""
    from pathlib import Path

    import pandas as pd

    from analyses import faithful_default

    folder = Path(__file__).resolve().parents[1] / "figures/studies/faithful_default_dev"
    table = pd.read_csv(folder / "qwen2.5-coder-0.5b-1024.csv")
    later = " rest |@0.5|leave_few_out"  # candidates added after the first run: rescored from the arrays
    done = table[~table.scorer.str.contains(later)]
    again = faithful_default.rescored(done, folder / "arrays", "qwen2.5-coder-0.5b")
    keys = ["task", "seed", "scorer"]
    both = done.merge(again, on=keys, suffixes=("", "_again"))
    assert len(both) == len(done)
    np.testing.assert_allclose(both.lds_again, both.lds, atol=1e-12)
    assert (both.top_source_found_again == both.top_source_found).all()
    added = again[~again.scorer.isin(done.scorer)]
    assert added.scorer.str.contains(later).all() and added.scorer.str.contains("leave_few_out").any()
    assert added[["task", "seed"]].drop_duplicates().shape[0] == 15


def test_adaptive_stopping_measures_the_top_twos_only_where_no_top_one_carries_the_answer():
    """``few_out_scores(stop_at=)``: each ranker's top 1 measured; their top 2 too only if no measured drop
    reaches ``stop_at`` nats. Measured sources score their drops, the rest the gradient."""
    from analyses import faithful_default

    gradient, flow = faithful_default.WEIGHTED
    rankings = {gradient: torch.tensor([6.0, 5, 4, 3, 2, 1]), flow: torch.tensor([1.0, 2, 6, 5, 4, 3])}
    measured = {"drops": torch.tensor([3.0, 0.5, 1.0, 0.2, 0.1, 0.0]), "rankings": rankings}
    scores, chosen = faithful_default.few_out_scores(measured, 2, stop_at=2.0)  # source 0 drops 3 nats
    assert sorted(chosen.tolist()) == [0, 2]
    assert torch.equal(scores, torch.tensor([3.0, 5, 1.0, 3, 2, 1]))
    _, chosen = faithful_default.few_out_scores(measured, 2, stop_at=4.0)  # none does: the top 2s too
    assert sorted(chosen.tolist()) == [0, 1, 2, 3]
    _, always = faithful_default.few_out_scores(measured, 2)
    assert sorted(always.tolist()) == [0, 1, 2, 3]


def test_measuring_until_the_top_is_measured_measures_each_estimated_first_source_in_turn():
    """``few_out_scores(until_top=True)``: while the highest score is an estimate, that source is measured;
    here the rankers' tops all drop less than the gradient's third and fourth estimate, as on a flat
    gradient: the third is measured (no drop), then the fourth (the largest drop), and it stops."""
    from analyses import faithful_default

    gradient, flow = faithful_default.WEIGHTED
    rankings = {gradient: torch.tensor([8.0, 7, 6, 5, 1, 0]), flow: torch.tensor([0.0, 0, 0, 0, 2, 9])}
    measured = {"drops": torch.tensor([-1.0, -2, 0, 4, 0.5, -3]), "rankings": rankings}
    scores, chosen = faithful_default.few_out_scores(measured, 2, until_top=True)
    assert chosen.tolist() == [0, 1, 5, 4, 2, 3]
    assert torch.equal(scores, measured["drops"])
    _, plain = faithful_default.few_out_scores(measured, 2)
    assert plain.tolist() == [0, 1, 5, 4]
    rankings[gradient][3] = 0.1  # the fourth's estimate then falls below a measured drop (source 4's 0.5)
    scores, chosen = faithful_default.few_out_scores(measured, 2, until_top=True)
    assert chosen.tolist() == [0, 1, 5, 4, 2] and int(torch.argmax(scores)) == 4


def test_development_aopcs_equal_one_removal_at_a_time(model, tokenizer, sample):
    """``--aopc``'s rows (``aopc_rows``: every scorer's top-k masks deduplicated into one call) equal a
    loop that removes, then keeps, each scorer's top k alone, one ``answer_scores`` call a mask; the
    candidate measuring the source before its top measures that source exactly."""
    from analyses import faithful_default
    from probe.faithfulness.masks import KS

    n = len(sample.sources)
    generator = torch.Generator().manual_seed(0)
    drops = torch.randn(n, generator=generator)
    drops[0] = -5.0  # the source before the top is measured even though its drop is the lowest
    drops[1] = 9.0
    rankings = {name: torch.randn(n, generator=generator) for name in faithful_default.WEIGHTED}
    rankings[faithful_default.WEIGHTED[0]][1] = 100.0  # the top ranker holds source 1
    measured = {"drops": drops, "rankings": rankings}
    scores, chosen = faithful_default.few_out_scores(measured, 2, before_top=True)
    assert 0 in chosen.tolist() and scores[0] == drops[0]
    about = {"task": "multihop-2", "seed": 1}
    rows = faithful_default.aopc_rows(model, tokenizer, about, measured, 300)
    full = float(faithfulness.answer_scores(model, sample, torch.zeros(1, n, dtype=torch.bool)).logprob[0])
    scorers = {"leave_one_out": drops} | {
        name: faithful_default.few_out_scores(measured, *options)[0]
        for name, options in faithful_default.AOPC_SCORERS.items()
    }
    assert [row["scorer"] for row in rows] == list(scorers)
    for row, values in zip(rows, scorers.values(), strict=True):
        order = torch.argsort(-values, stable=True)
        lost = {"removed": [], "kept": []}
        for k in KS:
            top = torch.zeros(1, n, dtype=torch.bool)
            top[0, order[:k]] = True
            for name, mask in (("removed", top), ("kept", ~top)):
                lost[name].append(full - float(faithfulness.answer_scores(model, sample, mask).logprob[0]))
        assert row["aopc_comprehensiveness"] == pytest.approx(np.mean(lost["removed"]), abs=1e-4)
        assert row["aopc_sufficiency"] == pytest.approx(np.mean(lost["kept"]), abs=1e-4)
