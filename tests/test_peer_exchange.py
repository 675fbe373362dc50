"""The peers' exchange (``analyses.peers.exchange``) round trip through a fake peer in another process."""

import argparse
import json
import math
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

import probe
from analyses.peers import exchange
from probe import tasks
from probe.models import converted_folder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def samples():
    tokenizer = AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))
    return [tasks.make("document-1", tokenizer, 200, seed=seed) for seed in (0, 1)]


@pytest.fixture(scope="module")
def model():
    vocab = len(AutoTokenizer.from_pretrained(converted_folder("smollm2-135m")))
    return probe.tiny_model("llama", vocab_size=vocab, max_position_embeddings=512)


def test_a_peer_round_trip_is_judged_like_our_detectors(samples, model, tmp_path):
    exported = exchange.export(samples, "model-folder", tmp_path / "samples.jsonl")
    fake_peer = [sys.executable, "-m", "analyses.peers.fake_peer", str(exported), str(tmp_path / "out.jsonl")]
    subprocess.run(fake_peer, cwd=ROOT, check=True)  # a runner runs from the repository root
    scores = exchange.read_scores(tmp_path / "out.jsonl", samples)
    for sample in samples:
        spans = [sample.char_spans[s.category][s.index] for s in sample.sources]
        lengths = [end - start for start, end in spans]
        assert scores[exchange.sample_key(sample)][0].tolist() == lengths
        assert math.isfinite(scores[exchange.sample_key(sample)][1])  # timed on this machine's CPU
        assert exchange.key_fields(exchange.sample_key(sample)) == (sample.task, sample.length, sample.seed)
    judged = probe.faithfulness.Judgement(ks=(1,), n_masks=8, ceiling_masks=24)
    table = exchange.judge(model, samples, {"fake": scores}, judged)
    assert set(table.scorer) == {"fake", "additive_ceiling"} and len(table) == 4
    one = samples[0]
    direct = probe.faithfulness.evaluate(model, one, {"fake": scores[exchange.sample_key(one)][0]}, judged)
    mine = table[table["sample"] == exchange.sample_key(one)].reset_index(drop=True)
    assert mine.lds.tolist() == pytest.approx(direct.lds.tolist())


def test_a_method_scored_after_its_sample_was_judged_is_added_to_the_part_alone(samples, model, tmp_path):
    """``exchange.judge_part``: a second method judged into a part holds the numbers it has when both are
    judged at once (its ``lds_share`` read off the part's own ceiling); the first method's row and the
    ceiling's stay as written; the cost unit is timed again for the second (its seconds may come from
    another machine than the first's); nothing new runs nothing."""
    sample, key = samples[0], exchange.sample_key(samples[0])
    n = len(sample.sources)
    methods = {"first": {key: (torch.arange(n, dtype=torch.float), 2.0)},
               "second": {key: (torch.arange(n, dtype=torch.float).flip(0) ** 2, 6.0)}}  # fmt: skip
    judged = probe.faithfulness.Judgement(ks=(1, 2), n_masks=8, ceiling_masks=24)
    part, units = tmp_path / f"{key}.csv", iter([0.5, 99.0])
    alone = {"first": methods["first"]}
    first = exchange.judge_part(part, model, sample, alone, lambda: next(units), judged)
    assert set(first.scorer) == {"first", "additive_ceiling"}
    both = exchange.judge_part(part, model, sample, methods, lambda: next(units), judged)
    assert both.scorer.tolist() == ["first", "additive_ceiling", "second"]
    pd.testing.assert_frame_equal(both.iloc[:2], first)
    at_once = exchange.judge(model, [sample], methods, judged).set_index("scorer")
    second = both.set_index("scorer").loc["second"]
    for column in ("lds", "lds_share", "comprehensiveness_k2", "sufficiency_k1", "correct_kept_k2"):
        assert second[column] == pytest.approx(at_once.loc["second", column], abs=1e-6)
    assert second.forwards == 6.0 / 99.0 and both.forward_seconds.tolist() == [0.5, 0.5, 99.0]
    assert pd.read_csv(part).equals(both)
    with patch.object(exchange, "judge", side_effect=AssertionError("nothing new to judge")):
        assert exchange.judge_part(part, model, sample, methods, lambda: 1.0, judged).equals(both)


@pytest.mark.parametrize(
    "line, message",
    [('{"key": "nope", "scores": []}', "was not exported"),
     ('{"key": "KEY", "scores": [1.0]}', "scores, one a source: got 1"),
     ('{"key": "KEY", "scores": NAN}', "not finite")],
)  # fmt: skip
def test_a_malformed_peer_answer_is_refused(samples, tmp_path, line, message):
    key, n = exchange.sample_key(samples[0]), len(samples[0].sources)
    bad = line.replace("KEY", key).replace("NAN", "[" + ", ".join(["NaN"] * n) + "]")
    (tmp_path / "out.jsonl").write_text(bad + "\n")
    with pytest.raises(probe.errors.InvalidValueError, match=message):
        exchange.read_scores(tmp_path / "out.jsonl", samples[:1])


def test_a_sample_the_peer_failed_on_is_a_recorded_failure_not_a_score(samples, tmp_path):
    first, second = (exchange.sample_key(s) for s in samples)
    n = len(samples[1].sources)
    (tmp_path / "out.jsonl").write_text(
        f'{{"key": "{first}", "error": "OutOfMemoryError: at 1024 tokens"}}\n'
        f'{{"key": "{second}", "scores": {[1.0] * n}, "seconds": 2.5, "cpu": "here"}}\n'
    )
    assert exchange.failures(tmp_path / "out.jsonl") == {first: "OutOfMemoryError: at 1024 tokens"}
    scores = exchange.read_scores(tmp_path / "out.jsonl", samples, cpu="here")
    assert list(scores) == [second] and scores[second][1] == 2.5


@pytest.mark.parametrize("line", ['"cpu": "another"', '"cpu": null', '"by": "no cpu named"'])
def test_seconds_measured_on_another_cpu_read_as_unknown(samples, tmp_path, line):
    """CPU seconds set against a forward pass timed here are a cost only when both ran on one kind of
    CPU: the seconds of a line from another (or none named) read as NaN, its scores as they are."""
    key, n = exchange.sample_key(samples[0]), len(samples[0].sources)
    (tmp_path / "out.jsonl").write_text(
        f'{{"key": "{key}", "scores": {[1.0] * n}, "seconds": 2.5, {line}}}\n'
    )
    scores, seconds = exchange.read_scores(tmp_path / "out.jsonl", samples[:1], cpu="here")[key]
    assert math.isnan(seconds) and scores.tolist() == [1.0] * n


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_a_runner_finds_longprobes_tokens_answer_and_sources_with_its_own_tokenizer(name, tmp_path):
    """peer_io (what every runner shares) recovers the exported ids with the peer's tokenizer (Gemma 3's
    added <bos> included), the answer's positions and each token's source, checked token by token."""
    import json

    from analyses.peers import peer_io

    tokenizer = AutoTokenizer.from_pretrained(converted_folder(name))
    sample = tasks.make("document-2", tokenizer, 300, seed=1)
    exported = json.loads(exchange.export([sample], "m", tmp_path / "s.jsonl").read_text())
    ids, offsets, answer = peer_io.tokens(tokenizer, exported)
    assert ids == sample.input_ids.tolist() and answer == sample.target_positions.tolist()
    owners = [None] * len(ids)
    for number, source in enumerate(sample.sources):
        owners[source.start : source.end] = [number] * (source.end - source.start)
    assert peer_io.source_of_token(offsets, exported["text"], exported["sources"]) == owners
    lengths = [source.end - source.start for source in sample.sources]
    assert peer_io.sum_by_source([1.0] * len(ids), offsets, exported) == lengths


@pytest.mark.parametrize(("name", "prefix"), [("smollm2-135m", ""), ("gemma3-270m", "<bos>")])
def test_a_peer_that_reads_text_alone_gets_longprobes_added_tokens_written_out(name, prefix, tmp_path):
    """AT2, ContextCite and FlashTrace tokenize text without special tokens: written_out puts Gemma 3's
    added <bos> in front of text and prompt (nothing for a chat-templated text), so their tokenizer gives
    the exported ids, and moves the sources with it; a sample whose ids do not match is refused."""
    import json

    from analyses.peers import peer_io

    tokenizer = AutoTokenizer.from_pretrained(converted_folder(name))
    sample = tasks.make("document-2", tokenizer, 300, seed=1)
    exported = json.loads(exchange.export([sample], "m", tmp_path / "s.jsonl").read_text())
    written = peer_io.written_out(tokenizer, exported)
    assert written["text"] == prefix + exported["text"] and written["prompt"] == prefix + exported["prompt"]
    assert tokenizer(written["text"], add_special_tokens=False)["input_ids"] == sample.input_ids.tolist()
    spans = [written["text"][start:end] for start, end in written["sources"]]
    assert spans == [exported["text"][start:end] for start, end in exported["sources"]]
    with pytest.raises(ValueError, match="does not give the exported input_ids"):
        peer_io.written_out(tokenizer, exported | {"input_ids": exported["input_ids"][:-1]})


def test_cutting_a_source_out_takes_the_whitespace_before_it_and_keeps_the_text_between():
    """``peer_io.cut_out``: ContextCite's ablation (its runner's ``SpanPartitioner``), by hand."""
    from analyses.peers import peer_io

    text = "Facts:  Ann is in the hall.\n\nBob has the key. Question?"
    sources = [[8, 27], [29, 45]]  # "Ann is in the hall." and "Bob has the key."
    assert [text[a:b] for a, b in peer_io.source_cuts(text, sources)] == [
        "  Ann is in the hall.",
        "\n\nBob has the key.",
    ]
    assert peer_io.cut_out(text, sources, [True, True]) == text
    assert peer_io.cut_out(text, sources, [False, True]) == "Facts:\n\nBob has the key. Question?"
    assert peer_io.cut_out(text, sources, [True, False]) == "Facts:  Ann is in the hall. Question?"
    assert peer_io.cut_out(text, sources, [False, False]) == "Facts: Question?"


def test_a_killed_run_resumes_where_it_stopped_and_writes_its_answers_once(tmp_path):
    """``peer_io.resumable``: finished lines survive a kill (a cut-off last line is run again), no job
    runs twice, and the answers file appears only when every job has its line."""
    from analyses.peers import peer_io

    out, ran = tmp_path / "scores.jsonl", []

    def job(key: str, kill: bool = False):
        def make() -> dict:
            if kill:
                raise KeyboardInterrupt  # the run is killed while this job runs
            ran.append(key)
            return {"key": key, "scores": [1.0], "seconds": 0.0}

        return key, make

    with pytest.raises(KeyboardInterrupt):
        peer_io.resumable(out, [job("a"), job("b"), job("c", kill=True)])
    assert not out.exists() and ran == ["a", "b"]
    partial = out.with_name(out.name + ".partial")
    partial.write_text(partial.read_text() + '{"key": "c", "sco')  # a line cut off by the kill
    peer_io.resumable(out, [job("a"), job("b"), job("c")])
    assert ran == ["a", "b", "c"] and not partial.exists()
    assert {json.loads(line)["cpu"] for line in out.read_text().splitlines()} == {peer_io.cpu()}
    assert [json.loads(line)["key"] for line in out.read_text().splitlines()] == ["a", "b", "c"]


def test_a_journal_is_rewritten_without_its_cut_line_and_never_shortened_by_a_kill(tmp_path):
    """``peer_io.journaled`` drops a last line cut off by a kill and rewrites the journal by one rename: a
    kill while the new file is written leaves the old journal whole, and no temporary file stays."""
    from analyses.peers import peer_io

    journal = tmp_path / "out.jsonl.partial"
    whole = '{"key": "a"}\n{"key": "b"}\n'
    journal.write_text(whole + '{"key": "c", "sco')
    written = Path.write_text

    def killed(self, text):
        written(self, text[:5])  # the kill comes after five characters
        raise KeyboardInterrupt

    with patch.object(Path, "write_text", killed), pytest.raises(KeyboardInterrupt):
        peer_io.journaled(journal)
    assert journal.read_text() == whole + '{"key": "c", "sco'
    assert peer_io.journaled(journal) == [{"key": "a"}, {"key": "b"}]
    assert journal.read_text() == whole and [path.name for path in tmp_path.iterdir()] == [journal.name]


def test_a_runners_seconds_are_cpu_seconds_and_a_too_long_answer_is_a_failure_that_says_why(tmp_path):
    """``peer_io.run`` times the scoring with the process's CPU clock: a method that waits (another job
    on the core, a paused run) costs nothing extra, one that computes costs its computing; a sample
    whose answer is longer than ``--max-answer-tokens`` is not scored and its line says why."""
    from analyses.peers import peer_io

    exported = tmp_path / "samples.jsonl"
    line = '{{"key": "{}", "model": "m", "input_ids": [1, 2, 3, 4], "prompt_tokens": {}}}\n'
    exported.write_text(line.format("waits", 3) + line.format("computes", 3) + line.format("long", 1))
    out = tmp_path / "scores.jsonl"

    def score(sample: dict) -> list[float]:
        start = time.process_time()
        if sample["key"] == "waits":
            time.sleep(0.5)
        while sample["key"] == "computes" and time.process_time() - start < 0.2:
            pass
        return [1.0]

    peer_io.run(argparse.Namespace(exported=exported, out=out, max_answer_tokens=2), score)
    answers = {line["key"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert answers["waits"]["seconds"] < 0.1 and 0.2 <= answers["computes"]["seconds"] < 0.5
    assert answers["long"]["error"] == "not run: 3 answer tokens, --max-answer-tokens 2"
    assert peer_io.model_folders(exported) == {"m"}


def test_a_run_killed_inside_a_sample_resumes_at_its_next_step_and_counts_every_steps_seconds(tmp_path):
    """``peer_io.StepJournal``: the steps a killed run finished are read back, not run again (a step cut
    off by the kill runs again); the sample's ``seconds`` add the CPU seconds those steps took before the
    kill; the journal goes once every sample has its line."""
    from analyses.peers import peer_io

    exported, out = tmp_path / "samples.jsonl", tmp_path / "scores.jsonl"
    exported.write_text('{"key": "a", "model": "m", "input_ids": [1, 2, 3, 4], "prompt_tokens": 1}\n')
    args = argparse.Namespace(exported=exported, out=out, max_answer_tokens=None)
    ran = []

    def score(journal: peer_io.StepJournal, kill_at: int | None) -> list[float]:
        def step(position: int) -> list[float]:
            if position == kill_at:
                raise KeyboardInterrupt  # the run is killed while this step runs
            start = time.process_time()
            while time.process_time() - start < 0.1:
                pass
            ran.append(position)
            return [float(position), 0.5]

        values = [journal.step("a", position, partial(step, position)) for position in (1, 2, 3)]
        return [sum(column) for column in zip(*values, strict=True)]

    journal = peer_io.StepJournal(out)
    with pytest.raises(KeyboardInterrupt):
        peer_io.run(args, lambda sample: score(journal, kill_at=3), journal)
    journal.path.write_text(journal.path.read_text() + '{"key": "a", "step": 3, "val')  # cut off by the kill
    journal = peer_io.StepJournal(out)
    peer_io.run(args, lambda sample: score(journal, kill_at=None), journal)
    (answer,) = map(json.loads, out.read_text().splitlines())
    assert ran == [1, 2, 3] and answer["scores"] == [6.0, 1.5]
    assert 0.3 <= answer["seconds"] < 0.6 and not journal.path.exists()


def test_the_summary_gives_each_methods_lds_paired_with_the_best_one_pass_detectors(tmp_path):
    """``compare.summary``: each method's mean LDS and its paired difference from ``key_removal_banzhaf``'s;
    a sample whose LDS is undefined is not counted; ``results_markdown`` puts every run's summary in
    RESULTS.md's table."""
    import pandas as pd

    from analyses.peers import compare

    lds = {"key_removal_banzhaf": [0.8, 0.6, 0.7, 0.9], "peer": [0.7, 0.7, 0.5, 0.8]}
    table = pd.DataFrame(
        [{"sample": f"s{n}", "scorer": name, "source": "x", "lds": value, "aopc_comprehensiveness": 1.0,
          "lds_share": value / 0.9, "seconds": 2.0, "forwards": 4.0, "spearman_vs_ours": 0.5}
         for name, values in lds.items() for n, value in enumerate(values)]
    )  # fmt: skip
    found = compare.summary(table).set_index("method")
    assert found.loc["peer", "lds_minus_best"] == pytest.approx(-0.075)
    assert found.loc["peer", "lds_minus_best_low"] < -0.075 < found.loc["peer", "lds_minus_best_high"]
    assert found.loc["key_removal_banzhaf", "lds_minus_best"] == 0.0
    alone = compare.summary(table[table.scorer == "peer"]).set_index("method")
    assert alone.loc["peer", "samples"] == 4 and math.isnan(alone.loc["peer", "lds_minus_best"])
    constant = table.assign(lds=table.lds.where((table.scorer != "peer") | (table["sample"] != "s0")))
    counted = compare.summary(constant).set_index("method")  # a constant score has no LDS on s0
    assert counted.loc["peer", "samples"] == 3 and counted.loc["peer", "lds"] == pytest.approx(2.0 / 3)
    assert counted.loc["peer", "lds_minus_best"] == pytest.approx(-0.2 / 3)
    no_ceiling = compare.summary(table.drop(columns="lds_share")).set_index("method")  # --ceiling-masks 0
    assert no_ceiling.lds_share.isna().all() and no_ceiling.lds.equals(found.lds)
    assert compare.results_markdown(tmp_path) == "(no comparison has finished yet)"
    (tmp_path / "m-1024").mkdir()
    compare.summary(table.assign(source="peer")).to_csv(tmp_path / "m-1024" / "summary.csv", index=False)
    rows = compare.results_markdown(tmp_path).splitlines()
    peer = next(row for row in rows if "| peer |" in row).split(" | ")
    assert peer[:3] == ["| m-1024", "peer", "4"] and peer[3].startswith("0.68 [") and peer[4] == "0.75"
    assert peer[5].startswith("-0.08 [") and peer[7:9] == ["2.0", "4.0"] and len(rows) == 4
    assert found.loc["peer", "aopc_minus_best"] == 0.0 and found.loc["peer", "aopc_comprehensiveness"] == 1.0
    fig = compare.plot(compare.summary(table), "m, 1024 tokens")
    ylabels = [ax.get_ylabel().split(" (")[0] for ax in fig.axes]
    assert ylabels == ["LDS", "AOPC of comprehensiveness − key_removal_banzhaf's, paired"]
    for ax, column in zip(fig.axes, ["lds", "aopc_minus_best"], strict=True):
        assert sorted(text.get_text() for text in ax.texts) == sorted(lds)
        points = sorted(map(tuple, ax.collections[0].get_offsets().tolist()))
        expected = sorted((4.0, found.loc[name, column]) for name in lds)
        assert np.allclose(points, expected)


def test_results_peers_table_is_what_the_committed_runs_say():
    """RESULTS.md's peers table equals ``results_markdown`` of the committed ``bench/results/peers``."""
    from analyses.peers import compare

    text = (compare.ROOT / "RESULTS.md").read_text()
    start, end = compare.RESULTS_MARKERS
    committed = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert committed == compare.results_markdown(compare.ROOT / "bench" / "results" / "peers")


def test_exported_samples_carry_the_answer_asked_for_gold_or_the_models_own(model):
    """``--explain own``: each exported sample carries the model's greedy answer, teacher-forced, as the
    detector studies explain it (:func:`analyses.comparison.explained`); gold leaves the task's answer;
    the default is own for real questions only (a planted task keeps its gold answer)."""
    from analyses.comparison import greedy_answer
    from analyses.peers.export_samples import heldout_samples

    tokenizer = AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))
    gold = heldout_samples(model, tokenizer, ["kv"], 2, 0, 200, "gold")
    by_default = heldout_samples(model, tokenizer, ["kv"], 2, 0, 200)
    own = heldout_samples(model, tokenizer, ["kv"], 2, 0, 200, "own")
    for plain, default, mine in zip(gold, by_default, own, strict=True):
        assert default.answer == plain.answer == tasks.make("kv", tokenizer, 200, seed=plain.seed).answer
        given = greedy_answer(model, tokenizer, plain, None)["given"]
        assert mine.answer == (given or plain.answer)
        assert mine.prompt_text == plain.prompt_text
    assert any(mine.answer != plain.answer for plain, mine in zip(gold, own, strict=True))
