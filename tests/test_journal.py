"""The journal of a run of hours (:mod:`probe.journal`): masked passes and detections a killed run had
finished are read back, bit for bit, and nothing else is; on tiny models, against unjournaled runs."""

import dataclasses
import json

import pytest
import torch
from transformers import AutoTokenizer

import probe
from probe import detectors, faithfulness, tasks
from probe.detectors import registry
from probe.journal import Journal

NAMES = ["attention", "key_removal_grad", "lexical_overlap", "leave_one_out", "recency"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(probe.models.converted_folder("smollm2-135m"))


@pytest.fixture(scope="module")
def sample(tokenizer):
    return tasks.make("multihop-2", tokenizer, 300, seed=1)


@pytest.fixture(scope="module")
def model(tokenizer):
    return probe.tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=1024)


def test_a_killed_run_of_passes_goes_on_from_the_journal_bit_for_bit(model, sample, tmp_path, passes):
    """A run killed after 3 of 6 passes leaves those 3 in the journal (a line cut short by the kill is
    skipped); run again, only the other 3 run, the 3 come back exactly as written, and all 6 equal an
    unjournaled run. Outside the journal, or under another ablation, nothing is read."""
    removed = faithfulness.random_masks(len(sample.sources), 6, seed=5)
    removed[0] = False
    plain = faithfulness.answer_scores(model, sample, removed)
    journal = Journal(tmp_path / "job")
    passes.kill_after(3)
    with pytest.raises(KeyboardInterrupt), journal:
        faithfulness.answer_scores(model, sample, removed)
    written = [json.loads(line) for line in journal.passes_file.read_text().splitlines()]
    assert len(written) == 3
    with journal.passes_file.open("a") as file:
        file.write('{"key": "' + written[0]["key"] + '", "removed": "01')  # killed while writing
    passes.kill_after(None)
    with Journal(tmp_path / "job"):
        again = faithfulness.answer_scores(model, sample, removed)
    assert passes.calls == 3
    assert (again.logprob - plain.logprob).abs().max() <= 1e-5 and torch.equal(again.correct, plain.correct)
    rows = {"".join(str(int(bit)) for bit in mask.tolist()): i for i, mask in enumerate(removed)}
    for entry in written:
        assert again.logprob[rows[entry["removed"]]].item() == entry["logprob"]  # as written, bit for bit
    passes.kill_after(None)
    faithfulness.answer_scores(model, sample, removed[:2])  # no journal: every mask runs
    with Journal(tmp_path / "job"):
        faithfulness.answer_scores(model, sample, removed[:1], compact=False)  # key masking: not read
    assert passes.calls == 3
    journal.clear()
    with journal:
        faithfulness.answer_scores(model, sample, removed[:1])  # cleared: runs again
    assert passes.calls == 4


def test_a_killed_run_of_detectors_reads_back_those_it_finished(model, sample, tmp_path, passes, monkeypatch):
    """Killed in ``leave_one_out`` (the fourth detector), a journaled :func:`detect_many` has written the
    three before it; run again it reads them (no shared pass), runs the rest, and every detection equals
    an unjournaled run's (one read back keeps the cost it had when it ran). Other options are not read."""
    options = {"leave_one_out": {"top_m": 3}}
    plain = detectors.detect_many(NAMES, model, None, sample, options)
    shared_passes = []
    run_pass = registry.run_pass
    monkeypatch.setattr(registry, "run_pass", lambda *args: shared_passes.append(1) or run_pass(*args))
    passes.kill_after(2)
    with pytest.raises(KeyboardInterrupt), Journal(tmp_path / "job"):
        detectors.detect_many(NAMES, model, None, sample, options)
    assert len(list((tmp_path / "job.detections").iterdir())) == 3
    passes.kill_after(None)
    with Journal(tmp_path / "job"):
        again = detectors.detect_many(NAMES, model, None, sample, options)
    assert len(shared_passes) == 1  # the killed run's only
    assert passes.calls == 4 - 2  # leave_one_out runs 4 passes (full, top 3): the 2 journaled are read
    for name in NAMES:
        first, second = plain[name], again[name]
        assert torch.equal(first.scores, second.scores) and torch.equal(first.flagged, second.flagged)
        assert first.settings == second.settings and second.sample is sample
        for key, value in first.details.items():
            assert (
                torch.equal(value, second.details[key])
                if torch.is_tensor(value)
                else value == second.details[key]
            )
    saved = json.loads(next((tmp_path / "job.detections").iterdir()).read_text())
    assert saved["seconds"] in [again[name].seconds for name in NAMES]  # the cost it had when it ran
    with Journal(tmp_path / "job"):
        other = detectors.detect_many(["attention"], model, None, sample, {"attention": {"top_k": 3}})
    assert len(shared_passes) == 2 and dataclasses.asdict(other["attention"])["settings"]["top_k"] == 3
