"""Causal faithfulness: key-masked answer log-probabilities against explicit-mask eager passes,
prefix-cache reuse against uncached passes, the ablation detectors against hand computations,
LDS on a planted additive model, and a hand-built model whose answer depends on one needle.

Compacted passes (only the kept tokens, at their original positions) against key masking: every
mask is measured in original positions (:func:`probe.attention.modifiers.original_positions`), so the
Gemma-3-style sliding windows, smaller here than the gaps a removed source opens, count positions
and not kept tokens; without that map the result is wrong (checked, so these tests can fail). Tiny
Llama and Gemma 3, nested modifiers, the architecture zoo, the real models at 1K."""

import dataclasses
import functools
import json

import numpy as np
import pandas as pd
import pytest
import torch
from reference import COMPACT_ATOL, eager_answer_logprob
from test_retrieval import copying_model

import probe
from probe import detectors, faithfulness, journal, tasks
from probe.faithfulness import Judgement, compaction, masks
from probe.probes.retrieval import needle_answer_positions

ATOL = 1e-5


def test_answer_scores_match_eager_with_explicit_masks_and_reuse_is_exact(model, sample):
    n_sources = len(sample.sources)
    removed = faithfulness.random_masks(n_sources, 5, seed=3)
    removed[0] = False  # the full context
    reused = faithfulness.answer_scores(model, sample, removed, faithfulness.Passes(reuse_prefix=True))
    uncached = faithfulness.answer_scores(model, sample, removed, faithfulness.Passes(reuse_prefix=False))
    assert (reused.logprob - uncached.logprob).abs().max() <= ATOL
    assert torch.equal(reused.correct, uncached.correct)
    for mask, got in zip(removed, reused.logprob, strict=True):
        hidden = compaction.removed_positions(sample.sources, mask).tolist()
        assert abs(eager_answer_logprob(model, sample, hidden) - float(got)) <= ATOL
    assert len(reused.logprob.unique()) == len(removed)  # the masks change the answer's log-prob
    for batch_size in (2, 5):
        how = faithfulness.Passes(batch_size=batch_size)
        batched = faithfulness.answer_scores(model, sample, removed, how)
        assert (batched.logprob - uncached.logprob).abs().max() <= ATOL
        assert torch.equal(batched.correct, uncached.correct)


@pytest.mark.parametrize("compact", [True, False], ids=["compacted", "key-masked"])
def test_passes_run_the_lm_head_on_the_answer_rows_only(model, sample, compact):
    """The passes that extend the prefix cache keep one row of logits: [rows, vocab] of a long prefix
    would not fit beside a large vocabulary (17 GB at 16K tokens on Gemma 3)."""
    rows_seen = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: rows_seen.append(args[0].shape[-2])
    )
    removed = faithfulness.random_masks(len(sample.sources), 4, seed=3)
    try:
        how = faithfulness.Passes(reuse_prefix=True, compact=compact)
        faithfulness.answer_scores(model, sample, removed, how)
    finally:
        hook.remove()
    assert len(rows_seen) > len(removed)  # the prefix cache was extended
    assert max(rows_seen) <= len(sample.target_positions)


@pytest.mark.parametrize("compact", [None, False], ids=["compacted", "key-masked"])
def test_leave_one_out_equals_hand_computed_differences(model, sample, compact):
    detection = probe.detect("leave_one_out", model, None, sample, compact=compact)
    assert detection.settings["compact"] is compact
    full = eager_answer_logprob(model, sample, [])
    for source, score in zip(sample.sources[:6], detection.details["source_scores"], strict=False):
        without = eager_answer_logprob(model, sample, range(source.start, source.end))
        assert abs((full - without) - float(score)) <= ATOL
        assert (detection.scores[source.start : source.end] == score).all()
    assert detection.name == "leave_one_out"


def test_leave_one_out_drops_of_chosen_sources_equal_hand_computed_differences(model, sample):
    chosen = [4, 0, 2]
    uncached = faithfulness.Passes(reuse_prefix=False)
    drops, ran = faithfulness.leave_one_out_drops(model, sample, chosen, uncached)
    full = eager_answer_logprob(model, sample, [])
    assert not ran.removed[0].any() and float(ran.scores.logprob[0]) == pytest.approx(full, abs=ATOL)
    assert ran.removed[1:].sum(1).tolist() == [1, 1, 1] and ran.removed[1:].nonzero()[:, 1].tolist() == chosen
    for index, drop in zip(chosen, drops, strict=True):
        source = sample.sources[index]
        without = eager_answer_logprob(model, sample, range(source.start, source.end))
        assert float(drop) == pytest.approx(full - without, abs=ATOL)


def test_removal_drops_of_groups_equal_hand_computed_differences(model, sample):
    groups = [[0, 2], [1, 3, 4]]
    removed = torch.zeros(len(groups), len(sample.sources), dtype=torch.bool)
    for row, group in enumerate(groups):
        removed[row, group] = True
    drops, ran = faithfulness.removal_drops(model, sample, removed, faithfulness.Passes(reuse_prefix=False))
    assert not ran.removed[0].any() and torch.equal(ran.removed[1:], removed)
    full = eager_answer_logprob(model, sample, [])
    for group, drop in zip(groups, drops, strict=True):
        hidden = [p for i in group for p in range(sample.sources[i].start, sample.sources[i].end)]
        assert float(drop) == pytest.approx(full - eager_answer_logprob(model, sample, hidden), abs=ATOL)


def test_leave_one_out_finds_the_needle_a_hand_built_model_copies(tokenizer):
    sample = tasks.make("niah", tokenizer, 160, seed=0, depth=0.4)
    (needle,) = needle_answer_positions(sample)
    digits = sample.target_positions[-len(needle) :]  # the teacher-forced answer is " " + the digits
    assert torch.equal(sample.input_ids[digits], sample.input_ids[needle])
    model = copying_model(len(tokenizer), offset=int(digits[0]) - 1 - int(needle[0]))  # rows copy the needle
    detection = probe.detect("leave_one_out", model, tokenizer, sample)
    ranked = torch.argsort(detection.details["source_scores"], descending=True)
    top = sample.sources[int(ranked[0])]
    assert top.category == "supporting" and top.start <= needle[0] < top.end
    cite = probe.detect("context_cite", model, tokenizer, sample, n_masks=48)
    assert sample.sources[int(cite.details["source_scores"].argmax())] == top


def test_contextcites_lasso_recovers_planted_weights_in_target_units():
    """``lasso_surrogate``: weights per source kept (the standardization undone), 0 for a source no mask
    varies, predictions additive in those weights."""
    from probe.detectors.ablation import lasso_surrogate

    generator = torch.Generator().manual_seed(0)
    planted = torch.randn(12, generator=generator).double()
    kept = faithfulness.random_masks(12, 400, seed=2)
    kept[:, 5] = True  # kept by every mask: nothing to learn
    planted[5] = 0.0
    target = kept.double() @ planted - 7.0
    weights, predict = lasso_surrogate(kept, target, alpha=1e-6)
    torch.testing.assert_close(weights.double(), planted, atol=1e-4, rtol=0)
    other = faithfulness.random_masks(12, 5, seed=3)
    other[:, 5] = True
    np.testing.assert_allclose(predict(other), (other.double() @ planted - 7.0).numpy(), atol=1e-4)
    shrunk, _ = lasso_surrogate(kept, target, alpha=10.0)  # a penalty above every effect zeroes them all
    assert not shrunk.any()


def test_source_scores_by_hand(sample):
    token_scores = torch.arange(len(sample.input_ids), dtype=torch.float32)
    first = sample.sources[0]
    span = token_scores[first.start : first.end]
    assert faithfulness.source_scores(token_scores, sample.sources, "sum")[0] == span.sum()
    assert faithfulness.source_scores(token_scores, sample.sources, "mean")[0] == span.mean()
    assert faithfulness.source_scores(token_scores, sample.sources, "max")[0] == span.max()
    with pytest.raises(ValueError, match="reduce"):
        faithfulness.source_scores(token_scores, sample.sources, "median")
    with pytest.raises(ValueError, match="no sources"):
        faithfulness.source_scores(token_scores, [])


def test_evaluate_reports_the_drops_of_its_own_masks(model, sample):
    truth = faithfulness.ground_truth_scores(sample)
    frame = faithfulness.evaluate(model, sample, {"truth": truth}, Judgement(ks=(1, 2), n_masks=6))
    (row,) = frame.to_dict("records")
    masks = faithfulness.top_k_masks(truth, (1, 2))
    every = torch.cat([torch.zeros_like(masks[:1]), masks, ~masks])
    scores = faithfulness.answer_scores(model, sample, every)
    full, removed, kept = scores.logprob[0], scores.logprob[1:3], scores.logprob[3:]
    assert row["full_logprob"] == pytest.approx(float(full), abs=ATOL)
    assert row["comprehensiveness_k2"] == pytest.approx(float(full - removed[1]), abs=ATOL)
    assert row["sufficiency_k1"] == pytest.approx(float(full - kept[0]), abs=ATOL)
    assert row["aopc_comprehensiveness"] == pytest.approx(float((full - removed).mean()), abs=ATOL)


def test_evaluate_fits_the_ceiling_on_its_own_masks_and_shares_are_of_its_lds(model, sample):
    """The ceiling row is :func:`additive_ceiling` of hand-run passes over masks none of which is an
    LDS mask, judged like any scorer; every row's ``lds_share`` is its LDS over the ceiling's."""
    truth = faithfulness.ground_truth_scores(sample)
    scorers = {"truth": truth}
    judged = Judgement(ks=(1,), n_masks=8, seed=4, ceiling_masks=40)
    frame = faithfulness.evaluate(model, sample, scorers, judged)
    n = len(sample.sources)
    lds_masks = faithfulness.random_masks(n, 8, seed=4)
    fit = faithfulness.random_masks(n, 40, seed=4 + masks.CEILING_SEED)
    assert not (fit[:, None] == lds_masks[None]).all(-1).any()
    by_hand = faithfulness.additive_ceiling(fit, faithfulness.answer_scores(model, sample, ~fit).logprob)
    actual = faithfulness.answer_scores(model, sample, ~lds_masks).logprob
    ceiling = frame.set_index("scorer").loc["additive_ceiling"]
    assert ceiling.lds == pytest.approx(faithfulness.lds(by_hand, lds_masks, actual), abs=1e-6)
    truth_row = frame.set_index("scorer").loc["truth"]
    assert truth_row.lds_share == pytest.approx(truth_row.lds / ceiling.lds) and ceiling.lds_share == 1.0
    assert frame.attrs["ceiling_masks"] == 40
    with pytest.raises(ValueError, match="ceiling_masks"):
        faithfulness.evaluate(model, sample, {"truth": truth}, Judgement(ceiling_masks=-1))


def test_bad_masks_are_refused(model, sample):
    with pytest.raises(ValueError, match="sources"):
        faithfulness.answer_scores(model, sample, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="source indices"):  # indices, not a mask: refused, not cast
        faithfulness.answer_scores(model, sample, torch.tensor([[0, 3, 5]]))
    ones = torch.zeros(1, len(sample.sources), dtype=torch.long)  # a 0/1 mask of another dtype is one
    assert faithfulness.answer_scores(model, sample, ones).logprob.shape == (1,)
    with pytest.raises(ValueError, match="one value per source"):
        faithfulness.evaluate(model, sample, {"bad": torch.zeros(3)})


def test_pruned_and_hierarchical_leave_one_out_are_exact_where_they_measure(model, sample):
    exhaustive = probe.detect("leave_one_out", model, None, sample)
    n_sources = len(sample.sources)
    assert exhaustive.details["passes"] == n_sources + 1 and exhaustive.details["measured"].all()
    pruned = probe.detect("leave_one_out", model, None, sample, top_m=5, rank_by="attention")
    hierarchical = probe.detect("leave_one_out", model, None, sample, block=4, refine=2)
    assert pruned.details["passes"] == 6
    blocks = -(-n_sources // 4)
    assert hierarchical.details["passes"] == 1 + blocks + int(hierarchical.details["measured"].sum())
    for found in (pruned, hierarchical):
        measured = found.details["measured"]
        assert 0 < measured.sum() < n_sources
        assert torch.allclose(
            found.details["source_scores"][measured], exhaustive.details["source_scores"][measured], atol=ATOL
        )
    # an unrefined block shares its block's drop: the removal of the whole block, by hand
    unrefined = (~hierarchical.details["measured"]).nonzero()[0, 0]
    first = int(unrefined) // 4 * 4
    block = range(first, min(first + 4, n_sources))
    hidden = [p for i in block for p in range(sample.sources[i].start, sample.sources[i].end)]
    drop = eager_answer_logprob(model, sample, []) - eager_answer_logprob(model, sample, hidden)
    shared = float(hierarchical.details["source_scores"][unrefined])
    assert shared == pytest.approx(drop / len(block), abs=ATOL)
    # outside the top m: the ranking detector's source scores, scaled onto the measured drops
    attention = probe.detect("attention", model, None, sample)
    cheap = faithfulness.source_scores(attention.scores, sample.sources)
    outside = ~pruned.details["measured"]
    ratio = pruned.details["source_scores"][outside] / cheap[outside]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-4)
    with pytest.raises(ValueError, match="one way"):
        probe.detect("leave_one_out", model, None, sample, top_m=3, block=2)


def test_pruned_leave_one_out_reuses_the_ranking_a_shared_call_made(model, sample, sandbox):
    """In detect_many, a pruned leave-one-out ranks by the detection the call already made (same
    target): the same result as detect() alone, without running the ranking detector again."""
    alone = probe.detect("leave_one_out", model, None, sample, top_m=3, rank_by="embedding_grad")
    runs = []
    real = detectors.registry.lookup("embedding_grad")
    counted = functools.wraps(real)(lambda *args, **kwargs: runs.append(1) or real(*args, **kwargs))
    detectors.replace("embedding_grad", counted)
    names = ["attention", "embedding_grad", "leave_one_out"]
    options = {"leave_one_out": {"top_m": 3, "rank_by": "embedding_grad"}}
    found = detectors.detect_many(names, model, None, sample, options)
    assert runs == []  # embedding_grad came from the shared pass, and leave-one-out reused it
    assert torch.allclose(found["leave_one_out"].scores, alone.scores, atol=ATOL)
    assert found["leave_one_out"].details["passes"] == 4
    with pytest.raises(ValueError, match="one score per source"):
        probe.detect("leave_one_out", model, None, sample, top_m=3, ranking=torch.zeros(2))
    with pytest.raises(ValueError, match="give top_m too"):
        probe.detect("leave_one_out", model, None, sample, ranking=torch.zeros(len(sample.sources)))


def test_pruned_leave_one_out_ranked_by_several_detectors_against_a_brute_force_loop(model, sample, sandbox):
    """``rank_by`` naming two detectors removes the union of each one's top ``top_m`` one by one (each
    drop against an eager pass with the source's keys masked by hand) and scores every other source
    by the first detector's scores times the least-squares scale onto the drops; detect_many hands
    both rankings over, so neither runs again."""
    rankers, top_m = ["attention", "embedding_grad"], 2
    pruned = probe.detect("leave_one_out", model, None, sample, top_m=top_m, rank_by=rankers)
    rankings = [probe.detect(name, model, None, sample).source_scores(sample) for name in rankers]
    chosen = []
    for ranking in rankings:
        order = sorted(range(len(ranking)), key=lambda i: (-float(ranking[i]), i))
        chosen += [i for i in order[:top_m] if i not in chosen]
    assert 2 < len(chosen) <= 2 * top_m  # the two rankings differ here, so the union is larger
    assert pruned.details["measured"].nonzero().flatten().tolist() == sorted(chosen)
    assert pruned.details["passes"] == len(chosen) + 1
    full = eager_answer_logprob(model, sample, [])
    for i in chosen:
        hidden = range(sample.sources[i].start, sample.sources[i].end)
        drop = full - eager_answer_logprob(model, sample, hidden)
        assert float(pruned.details["source_scores"][i]) == pytest.approx(drop, abs=COMPACT_ATOL)
    first, drops = rankings[0].double().numpy(), pruned.details["source_scores"].double().numpy()
    (scale,), *_ = np.linalg.lstsq(first[chosen, None], drops[chosen], rcond=None)
    rest = [i for i in range(len(sample.sources)) if i not in chosen]
    np.testing.assert_allclose(drops[rest], scale * first[rest], rtol=1e-4, atol=1e-7)
    assert pruned.settings["rank_by"] == rankers

    runs = []
    for name in rankers:
        real = detectors.registry.lookup(name)
        counted = functools.wraps(real)(lambda *a, real=real, **kw: runs.append(1) or real(*a, **kw))
        detectors.replace(name, counted)
    options = {"leave_one_out": {"top_m": top_m, "rank_by": rankers}}
    found = detectors.detect_many([*rankers, "leave_one_out"], model, None, sample, options)
    assert runs == []  # both came from the shared pass, and leave-one-out reused them
    assert torch.allclose(found["leave_one_out"].scores, pruned.scores, atol=ATOL)
    with pytest.raises(ValueError, match="for each of the 2 rank_by"):
        probe.detect("leave_one_out", model, None, sample, top_m=2, rank_by=rankers, ranking=rankings[0])
    for wrong, message in ((["attention", "nonsense"], "unknown detector"), (["leave_one_out"], "other")):
        with pytest.raises(ValueError, match=message):
            probe.detect("leave_one_out", model, None, sample, top_m=2, rank_by=wrong)
    assert runs == []  # refused before any detector ran


def test_evaluate_takes_the_masks_leave_one_out_ran_instead_of_running_them_again(model, sample, monkeypatch):
    """Masks in ``known`` (a leave-one-out's own passes) give the same evaluation as running them,
    and only the other masks run."""
    exact = probe.detect("leave_one_out", model, None, sample, top_m=3, rank_by="attention")
    scores = {"loo": exact.source_scores(), "truth": faithfulness.ground_truth_scores(sample)}
    ran = []
    real = faithfulness.answer_scores
    monkeypatch.setattr(
        faithfulness, "answer_scores", lambda m, s, mask, **kw: ran.append(mask) or real(m, s, mask, **kw)
    )
    judged = Judgement(ks=[1, 2], n_masks=4)
    plain = faithfulness.evaluate(model, sample, scores, judged)
    known = faithfulness.Ablations.of(exact)
    reused = faithfulness.evaluate(model, sample, scores, judged, known=[known])
    numbers = plain.select_dtypes("number").columns
    assert (reused[numbers] - plain[numbers]).abs().max().max() <= ATOL
    everything, rest = ran
    in_known = (everything[:, None] == known.removed[None]).all(-1).any(1)
    assert in_known.sum() >= 2  # the full context and the removal of loo's top source
    assert torch.equal(rest, everything[~in_known])  # only the others ran
    assert faithfulness.Ablations.of(probe.detect("attention", model, None, sample)) is None
    with pytest.raises(ValueError, match="sources"):
        wrong = faithfulness.Ablations(known.removed[:, :-1], known.scores)
        faithfulness.evaluate(model, sample, scores, Judgement(ks=[1], n_masks=4), known=[wrong])


def test_recorded_passes_saved_as_a_table_judge_other_scores_without_running_again(
    model, sample, tokenizer, monkeypatch
):
    """``record`` collects every pass an evaluation runs; saved (``to_frame``) and read back for the
    same sample (``from_frame``), they judge other scores with only those scores' own top-k masks
    run, and the numbers equal a fresh evaluation's. Another sample finds none of them."""
    first = {"truth": faithfulness.ground_truth_scores(sample)}
    record, judged = [], Judgement(ks=[1, 2], n_masks=6)
    ceiling = dataclasses.replace(judged, ceiling_masks=8)
    plain = faithfulness.evaluate(model, sample, first, ceiling, record=record)
    table = pd.concat([one.to_frame(sample) for one in record])
    assert table.removed.str.len().eq(len(sample.sources)).all() and not table.duplicated("removed").any()
    known = faithfulness.Ablations.from_frame(table, sample)
    ran = []
    real = faithfulness.answer_scores
    monkeypatch.setattr(
        faithfulness, "answer_scores", lambda m, s, mask, **kw: ran.append(mask) or real(m, s, mask, **kw)
    )
    again = faithfulness.evaluate(model, sample, first, ceiling, known=[known])
    numbers = plain.select_dtypes("number").columns
    assert ran == [] and (again[numbers] - plain[numbers]).abs().max().max() <= ATOL
    other = {"other": torch.linspace(1, 0, len(sample.sources))}
    reused = faithfulness.evaluate(model, sample, other, judged, known=[known])
    monkeypatch.setattr(faithfulness, "answer_scores", real)
    fresh = faithfulness.evaluate(model, sample, other, judged)
    columns = fresh.select_dtypes("number").columns
    assert (reused[columns] - fresh[columns]).abs().max().max() <= ATOL
    (mine,) = ran
    assert not (mine[:, None] == known.removed[None]).all(-1).any(1).any()  # only masks not saved ran
    another = tasks.make("multihop-2", tokenizer, 300, seed=sample.seed + 1)
    assert len(faithfulness.Ablations.from_frame(table, another).removed) == 0
    with pytest.raises(ValueError, match="record must be a list"):
        faithfulness.evaluate(model, sample, first, record=())


def test_a_killed_run_of_passes_goes_on_from_the_journal_bit_for_bit(model, sample, tmp_path, passes):
    """A run killed after 3 of 6 passes leaves those 3 in the journal (a line cut short by the kill is
    skipped); run again, only the other 3 run, the 3 come back exactly as written, and all 6 equal an
    unjournaled run. Outside the journal, or under another ablation, nothing is read."""
    removed = faithfulness.random_masks(len(sample.sources), 6, seed=5)
    removed[0] = False
    plain = faithfulness.answer_scores(model, sample, removed)
    kept = journal.Journal(tmp_path / "job")
    passes.kill_after(3)
    with pytest.raises(KeyboardInterrupt), kept:
        faithfulness.answer_scores(model, sample, removed)
    written = [json.loads(line) for line in kept.passes_file.read_text().splitlines()]
    assert len(written) == 3
    with kept.passes_file.open("a") as file:
        file.write('{"key": "' + written[0]["key"] + '", "removed": "01')  # killed while writing
    passes.kill_after(None)
    with journal.Journal(tmp_path / "job"):
        again = faithfulness.answer_scores(model, sample, removed)
    assert passes.calls == 3 and len(kept.passes_file.read_text().splitlines()) == 3 + 1 + 3
    assert not journal.Journal(tmp_path / "job").read_passes(written[0]["key"], removed).keys() ^ set(
        range(6)
    )
    assert (again.logprob - plain.logprob).abs().max() <= 1e-5 and torch.equal(again.correct, plain.correct)
    rows = {"".join(str(int(bit)) for bit in mask.tolist()): i for i, mask in enumerate(removed)}
    for entry in written:
        assert again.logprob[rows[entry["removed"]]].item() == entry["logprob"]  # as written, bit for bit
    passes.kill_after(None)
    faithfulness.answer_scores(model, sample, removed[:2])  # no journal: every mask runs
    with journal.Journal(tmp_path / "job"):
        key_masking = faithfulness.Passes(compact=False)
        faithfulness.answer_scores(model, sample, removed[:1], key_masking)  # not read
    assert passes.calls == 3
    kept.clear()
    with kept:
        faithfulness.answer_scores(model, sample, removed[:1])  # cleared: runs again
    assert passes.calls == 4


def test_nan_scores_empty_ks_and_too_few_masks_are_refused(model, sample):
    n_sources = len(sample.sources)
    nan = torch.zeros(n_sources)
    nan[2] = float("nan")
    with pytest.raises(ValueError, match=r"scores\['broken'\] holds NaN"):
        faithfulness.evaluate(model, sample, {"broken": nan})
    truth = {"truth": faithfulness.ground_truth_scores(sample)}
    with pytest.raises(ValueError, match="ks must be"):
        faithfulness.evaluate(model, sample, truth, Judgement(ks=()))
    with pytest.raises(ValueError, match="n_masks must be"):
        faithfulness.evaluate(model, sample, truth, Judgement(n_masks=0))
    with pytest.raises(ValueError, match="one value per source"):
        faithfulness.evaluate(model, sample, {"list": [0.0] * n_sources})


def test_saved_passes_give_back_each_masks_logprob_and_exhaustive_leave_one_out(model, sample, tokenizer):
    """From one sample's saved table (``from_frame`` without the sample), ``logprob_of`` gives each
    kept mask's log P as a direct ``answer_scores`` pass does, and ``leave_one_out`` equals the
    ``leave_one_out`` detector's exhaustive scores; a mask not run, or a table of two samples, is refused."""
    exact = probe.detect("leave_one_out", model, None, sample)
    record = [faithfulness.Ablations.of(exact)]  # its single removals, as a study records them
    scores = {"loo": exact.source_scores()}
    faithfulness.evaluate(model, sample, scores, Judgement(ks=[1], n_masks=4), known=record[:], record=record)
    table = pd.concat([one.to_frame(sample) for one in record])
    known = faithfulness.Ablations.from_frame(table)
    assert torch.equal(known.removed, faithfulness.Ablations.from_frame(table, sample).removed)
    kept = faithfulness.random_masks(len(sample.sources), 4, seed=0)
    direct = faithfulness.answer_scores(model, sample, ~kept).logprob
    assert torch.allclose(known.logprob_of(kept), direct, atol=ATOL)
    assert torch.allclose(known.leave_one_out(), exact.source_scores(), atol=ATOL)
    with pytest.raises(ValueError, match="1 of 1 masks were not run"):
        known.logprob_of(torch.zeros(1, len(sample.sources), dtype=torch.bool))
    another = tasks.make("multihop-2", tokenizer, 300, seed=sample.seed + 1)
    two = pd.concat([table, table.assign(sample=faithfulness.sample_digest(another))])
    with pytest.raises(ValueError, match="2 samples"):
        faithfulness.Ablations.from_frame(two)
