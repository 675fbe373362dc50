"""Your own text as a sample (Sample.from_text), probe.attribute and its CLI, on the real tokenizers
and a tiny model saved with the SmolLM2 tokenizer."""

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

import probe
from analyses import attribute as attribute_cli
from probe import faithfulness, metrics
from probe.models import converted_folder
from probe.tasks import Sample

CONTEXT = (
    "The Eiffel Tower was finished in 1889. It was designed by the engineering firm of Gustave Eiffel! "
    'Critics called it "a useless monster." Today it is the most visited paid monument in the world.\n\n'
    "Paris has about two million inhabitants. The Seine runs through the city."
)
QUERY = "When was the Eiffel Tower finished?"


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def tokenizer(request):
    return AutoTokenizer.from_pretrained(converted_folder(request.param))


def test_sentences_are_exact_spans_of_the_one_tokenization(tokenizer):
    sample = Sample.from_text(tokenizer, CONTEXT, QUERY, "1889")
    texts = [sample.text[slice(*span)] for span in sample.char_spans["context"]]
    assert texts == [
        "The Eiffel Tower was finished in 1889.",
        "It was designed by the engineering firm of Gustave Eiffel!",
        'Critics called it "a useless monster."',
        "Today it is the most visited paid monument in the world.",
        "Paris has about two million inhabitants.",
        "The Seine runs through the city.",
    ]
    assert [s.category for s in sample.sources] == ["context"] * 6
    for source, text in zip(sample.sources, texts, strict=True):
        assert tokenizer.decode(sample.input_ids[source.start : source.end]).strip() == text
    assert tokenizer.decode(sample.input_ids[sample.target_positions]).strip() == "1889"
    assert CONTEXT in sample.text  # verbatim
    assert sample.score("It was finished in 1889.") == 1.0


def test_paragraphs_strings_and_spans_choose_the_sources(tokenizer):
    paragraphs = Sample.from_text(tokenizer, CONTEXT, QUERY, "1889", sources="paragraphs")
    assert len(paragraphs.sources) == 2
    given = Sample.from_text(tokenizer, CONTEXT, QUERY, "1889", sources=["The Eiffel Tower", "Paris has"])
    assert [given.text[slice(*s)] for s in given.char_spans["context"]] == ["The Eiffel Tower", "Paris has"]
    spans = Sample.from_text(tokenizer, CONTEXT, QUERY, "1889", sources=[(0, 3), (4, 10)])
    assert [spans.text[slice(*s)] for s in spans.char_spans["context"]] == ["The", "Eiffel"]
    with pytest.raises(ValueError, match="does not occur"):
        Sample.from_text(tokenizer, CONTEXT, QUERY, "1889", sources=["Paris has", "The Eiffel Tower"])
    with pytest.raises(ValueError, match="overlaps"):
        Sample.from_text(tokenizer, CONTEXT, QUERY, "1889", sources=[(0, 10), (5, 12)])
    with pytest.raises(ValueError, match="sentences"):
        Sample.from_text(tokenizer, CONTEXT, QUERY, "1889", sources="words")
    with pytest.raises(ValueError, match="query"):
        Sample.from_text(tokenizer, CONTEXT, "  ", "1889")


def test_a_prompt_without_response_ends_where_the_answer_would_start(tokenizer):
    prompt = Sample.from_text(tokenizer, CONTEXT, QUERY)
    full = Sample.from_text(tokenizer, CONTEXT, QUERY, "1889")
    assert len(prompt.target_positions) == 0 and prompt.prompt_length == len(prompt.input_ids)
    assert torch.equal(prompt.input_ids, full.input_ids[: len(prompt.input_ids)])


@pytest.fixture(scope="module")
def tiny(tiny_model_folder):
    return probe.load_model(tiny_model_folder)


def test_attribute_explains_a_response_per_source_and_every_measure_takes_it(tiny):
    model, tokenizer = tiny
    found = probe.attribute(model, tokenizer, CONTEXT, QUERY, response="1889", detector="leave_one_out")
    frame = found.to_frame()
    assert list(frame.columns[:6]) == ["source", "category", "start", "end", "text", "score"]
    assert len(frame) == 6 and sorted(frame["rank"]) == list(range(1, 7))
    assert frame.loc[frame.score.idxmax(), "rank"] == 1
    sample = found.sample
    by_hand = faithfulness.answer_scores(model, sample, torch.eye(6, dtype=torch.bool)[:1]).logprob[0]
    full = faithfulness.answer_scores(model, sample, torch.zeros(1, 6, dtype=torch.bool)).logprob[0]
    assert frame.score[0] == pytest.approx(float(full - by_hand), abs=1e-4)
    assert "longprobe-view" in found._repr_html_()
    assert set(metrics.plausibility(found, sample)) >= {"auroc", "fact_hit_rate"}
    faithful = faithfulness.evaluate(
        model, sample, {"loo": found.source_scores()}, faithfulness.Judgement(n_masks=4)
    )
    assert len(faithful) == 1
    generated = probe.attribute(model, tokenizer, CONTEXT, QUERY, max_new_tokens=3)
    assert generated.sample.answer == probe.answer(
        model, tokenizer, Sample.from_text(tokenizer, CONTEXT, QUERY), 3
    )


def test_the_cli_writes_sources_view_and_faithfulness(tiny_model_folder, tmp_path):
    document = tmp_path / "doc.txt"
    document.write_text(CONTEXT)
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model_folder), "--context", str(document), "--query", QUERY,
            "--response", "1889", "--faithfulness", "--masks", "4", "--device", "cpu",
            "--out", str(out)]  # fmt: skip
    table = attribute_cli.main(argv)
    written = pd.read_csv(out / "sources.csv")
    assert len(written) == len(table) == 6 and written["rank"].tolist() == list(range(1, 7))
    assert "longprobe-view" in (out / "view.html").read_text()
    faithful = pd.read_csv(out / "faithfulness.csv")
    assert set(faithful.scorer) == {"key_removal_banzhaf", "leave_one_out", "random_sources"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"--context": "missing.txt"}, "not a file"),
        ({"--query": " "}, "query is empty"),
        ({"--device": "cuda:7"}, "not available"),
        ({"--detector": "nope"}, "invalid choice"),
    ],
)
def test_the_cli_refuses_bad_arguments_before_loading_a_model(tmp_path, capsys, change, message):
    document = tmp_path / "doc.txt"
    document.write_text(CONTEXT)
    argv = {
        "--model": "never-loaded/model",
        "--context": str(document),
        "--query": QUERY,
        "--out": str(tmp_path / "o"),
    }
    argv = [x for pair in (argv | change).items() for x in pair]
    with pytest.raises(SystemExit):
        attribute_cli.main(argv)
    assert message in capsys.readouterr().err


PLANTED = "The lighthouse keeper on Bell Rock was named Margaret Ainsley."


def planted_essay(tokenizer, tokens: int) -> str:
    """An essay of about ``tokens`` tokens with :data:`PLANTED` after a sentence near its middle."""
    from probe.tasks.noise import essay_documents

    essay = essay_documents(tokenizer, tokens)[0]
    cut = essay.index(". ", len(essay) // 2) + 2
    return essay[:cut] + PLANTED + " " + essay[cut:]


@pytest.mark.real
def test_the_planted_sentence_is_found_in_an_essay_and_its_removal_costs_the_answer(smollm2):
    """The README's quick start: SmolLM2 answers from the one sentence that says it, information flow
    ranks that sentence first of ~100, and removing it takes the answer away."""
    model, tokenizer = smollm2
    context = planted_essay(tokenizer, 2000)
    found = probe.attribute(model, tokenizer, context, "Who was the lighthouse keeper on Bell Rock?",
                            detector="information_flow")  # fmt: skip
    frame = found.to_frame()
    assert "Margaret Ainsley" in found.sample.answer and len(frame) > 50
    assert PLANTED in frame.nsmallest(3, "rank").text.tolist()
    removed = torch.zeros(2, len(frame), dtype=torch.bool)
    removed[1, frame.text.tolist().index(PLANTED)] = True
    logprob = faithfulness.answer_scores(model, found.sample, removed).logprob
    assert logprob[1] < logprob[0] - 10  # nats: the answer needs that sentence


@pytest.mark.real
def test_attribute_works_on_an_essay_with_paragraph_breaks_with_qwen():
    """Qwen2.5's BPE merges a paragraph's closing ``.\\n\\n`` into one token: the sentence owns it, and
    the planted sentence is found and needed."""
    from probe.tasks.noise import sentences

    model, tokenizer = probe.load_model("qwen2.5-coder-0.5b")
    essay = sentences()[300:360]
    paragraphs = [" ".join(essay[i : i + 5]) for i in range(0, len(essay), 5)]
    paragraphs[len(paragraphs) // 2] += " " + PLANTED
    context = "\n\n".join(paragraphs)
    found = probe.attribute(model, tokenizer, context, "Who was the lighthouse keeper on Bell Rock?",
                            detector="key_removal_banzhaf")  # fmt: skip
    sample, frame = found.sample, found.to_frame()
    assert sample.cuts == () and "Margaret Ainsley" in sample.answer
    closing = [tokenizer.decode(sample.input_ids[source.end - 1]) for source in sample.sources]
    assert sum(token.endswith("\n\n") for token in closing) == len(paragraphs)  # the last before "Question"
    assert PLANTED in frame.nsmallest(3, "rank").text.tolist()
    removed = torch.zeros(2, len(frame), dtype=torch.bool)
    removed[1, frame.text.tolist().index(PLANTED)] = True
    logprob = faithfulness.answer_scores(model, sample, removed).logprob
    assert logprob[1] < logprob[0] - 5  # nats: the answer needs that sentence
