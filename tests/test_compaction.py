"""Compacted passes (only the kept tokens, at their original positions) against key masking and explicit
eager masks: every mask is measured in original positions
(:func:`probe.attention.modifiers.original_positions`), so
the Gemma-3-style sliding windows, smaller here than the gaps a removed source opens, count positions and
not kept tokens; without that map the result is wrong (checked, so these tests can fail). Tiny Llama and
Gemma 3, nested modifiers, the architecture zoo, the real models at 1K."""

import dataclasses

import pytest
import torch
from reference import COMPACT_ATOL, eager_answer_logprob
from test_architectures import ARCHITECTURES, build

import probe
from probe import faithfulness, tasks
from probe.attention.modifiers import original_positions
from probe.faithfulness import compaction


def compaction_masks(n_sources: int) -> torch.Tensor:
    """Random half masks, the full context, one source removed, all but one removed (sufficiency)."""
    removed = faithfulness.random_masks(n_sources, 4, seed=3)
    one = torch.zeros(2, n_sources, dtype=torch.bool)
    one[0, n_sources // 2] = True
    one[1] = True
    one[1, 2] = False
    return torch.cat([removed, torch.zeros(1, n_sources, dtype=torch.bool), one])


@pytest.mark.parametrize("reuse_prefix", [True, False])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_compaction_equals_key_masking_and_explicit_eager_masks(model, sample, reuse_prefix, batch_size):
    removed = compaction_masks(len(sample.sources))
    uncached = faithfulness.Passes(reuse_prefix=False, compact=False)
    masked = faithfulness.answer_scores(model, sample, removed, uncached)
    how = faithfulness.Passes(reuse_prefix, batch_size, compact=True)
    compact = faithfulness.answer_scores(model, sample, removed, how)
    assert (compact.logprob - masked.logprob).abs().max() <= COMPACT_ATOL
    assert torch.equal(compact.correct, masked.correct)
    hidden = compaction.removed_positions(sample.sources, removed[0]).tolist()
    assert abs(eager_answer_logprob(model, sample, hidden) - float(compact.logprob[0])) <= COMPACT_ATOL
    assert compact.logprob.unique().numel() == len(removed)  # every mask changes the answer


def test_windows_count_positions_not_kept_tokens(tokenizer, sample):
    """Without the map to original positions, Gemma 3's 6-token windows would count kept tokens."""
    model = probe.tiny_model("gemma3", vocab_size=len(tokenizer), max_position_embeddings=1024)
    removed = compaction_masks(len(sample.sources))[:1]
    expected = faithfulness.answer_scores(model, sample, removed, faithfulness.Passes(compact=False)).logprob
    hidden = compaction.removed_positions(sample.sources, removed[0])
    kept = torch.ones(len(sample.input_ids), dtype=torch.bool)
    kept[hidden] = False
    positions = kept.nonzero()[:, 0]
    rows = sample.target_positions - 1
    compact_rows = torch.searchsorted(positions, rows)
    with torch.no_grad():
        naive = model(
            input_ids=sample.input_ids[positions][None],
            position_ids=positions[None],
            attention_mask=torch.ones(1, len(positions), dtype=torch.long),
            logits_to_keep=compact_rows,
        ).logits[0]
    gold = sample.input_ids[sample.target_positions]
    naive_logprob = naive.log_softmax(-1).gather(-1, gold[:, None]).sum()
    assert abs(float(naive_logprob) - float(expected[0])) > 10 * COMPACT_ATOL
    assert (
        abs(float(faithfulness.answer_scores(model, sample, removed).logprob[0] - expected[0]))
        <= COMPACT_ATOL
    )


def test_compaction_under_nested_modifiers(model, sample):
    removed = compaction_masks(len(sample.sources))
    with probe.attention_window(model, 40), probe.ablate_heads(model, [(1, 0)]):
        masked = faithfulness.answer_scores(model, sample, removed, faithfulness.Passes(compact=False))
        batched = faithfulness.Passes(batch_size=2, compact=True)
        compact = faithfulness.answer_scores(model, sample, removed, batched)
    plain = faithfulness.answer_scores(model, sample, removed, faithfulness.Passes(compact=True))
    assert (compact.logprob - masked.logprob).abs().max() <= COMPACT_ATOL
    assert (plain.logprob - masked.logprob).abs().min() > COMPACT_ATOL  # the modifiers change every answer


def test_compaction_is_the_default_where_positions_come_from_position_ids(model, sample):
    assert compaction.compaction_supported(model)
    frame = faithfulness.evaluate(
        model, sample, {"truth": faithfulness.ground_truth_scores(sample)}, faithfulness.Judgement(n_masks=4)
    )
    assert frame.attrs["ablation"] == "compaction"
    frame = faithfulness.evaluate(
        model,
        sample,
        {"truth": faithfulness.ground_truth_scores(sample)},
        faithfulness.Judgement(n_masks=4),
        faithfulness.Passes(compact=False),
    )
    assert frame.attrs["ablation"] == "key_masking"


def test_sources_after_the_answer_are_refused(model, sample):
    late = (int(sample.target_positions[0]) - 1, int(sample.target_positions[-1]) + 1)
    broken = dataclasses.replace(
        sample, spans={**sample.spans, "supporting": [*sample.spans["supporting"], late]}
    )
    removed = torch.zeros(1, len(broken.sources), dtype=torch.bool)
    removed[0, -1] = True
    with pytest.raises(ValueError, match="before the answer"):
        faithfulness.answer_scores(model, broken, removed)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_compacted_forward_equals_key_masking_on_the_architecture_zoo(name):
    model = build(name)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    hidden = torch.zeros(1, 40, dtype=torch.bool)
    hidden[0, 5:15] = hidden[0, 20:26] = True  # gaps wider than the 6-token windows
    rows = torch.tensor([36, 37, 38])
    positions = (~hidden[0]).nonzero()[:, 0]
    with torch.no_grad():
        with probe.mask_keys(model, hidden):
            expected = model(input_ids=ids, use_cache=False, logits_to_keep=rows).logits
        with original_positions(model, positions[None]):
            compact = model(
                input_ids=ids[:, positions],
                position_ids=positions[None],
                attention_mask=torch.ones(1, len(positions), dtype=torch.long),
                use_cache=False,
                logits_to_keep=torch.searchsorted(positions, rows),
            ).logits
    assert (compact - expected).abs().max() <= 1e-4


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_compaction_equals_key_masking_on_the_real_models_at_1k(name):
    model, tokenizer = probe.load_model(name)
    sample = tasks.make("multihop-2", tokenizer, 1024, seed=0)
    removed = compaction_masks(len(sample.sources))[[0, 5, 6]]  # half, one, all but one removed
    masked = faithfulness.answer_scores(model, sample, removed, faithfulness.Passes(compact=False))
    compact = faithfulness.answer_scores(model, sample, removed, faithfulness.Passes(compact=True))
    assert (compact.logprob - masked.logprob).abs().max() <= COMPACT_ATOL
    assert torch.equal(compact.correct, masked.correct)
