"""One target for every probe (probe.target): the default is the answer's log-probability, a contrast
subtracts a foil's, any callable works; gradient probes and ablations agree with hand-written losses."""

import pytest
import torch
from transformers import AutoTokenizer

import probe
from analyses.objectives import interference_answers, response_ids
from probe import detectors, faithfulness, tasks
from probe.models import converted_folder
from probe.probes.attribution import embedding_grads
from probe.probes.key_removal import key_removal_gradient
from probe.target import AnswerToken, Contrast, answer_logprob


@pytest.fixture(scope="module")
def story():
    """A 2-hop story, its interference fact's answer as the foil, a tiny model over its vocabulary."""
    tokenizer = AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))
    sample = tasks.make("multihop-2", tokenizer, 256, seed=3)
    answer = sample.input_ids[sample.target_positions]
    foils = [response_ids(sample, tokenizer, text) for text in interference_answers(sample)]
    foil = next(f for f in foils if len(f) == len(answer) and not torch.equal(f, answer))
    model = probe.tiny_model("llama", vocab_size=len(tokenizer)).double()
    return model, tokenizer, sample, foil


def hand_logprob(model, sample, tokens: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_t log p(tokens_t) at the answer rows, written out: the full logits, log_softmax, pick."""
    ids = sample.input_ids[None]
    inputs = {"inputs_embeds": embeds} if embeds is not None else {"input_ids": ids}
    logits = model(**inputs, use_cache=False).logits[0, sample.target_positions - 1]
    return torch.log_softmax(logits.double(), -1)[torch.arange(len(tokens)), tokens].sum()


def test_the_default_and_a_contrast_target_equal_their_hand_written_losses(story):
    model, _, sample, foil = story
    answer = sample.input_ids[sample.target_positions]
    embeds = model.get_input_embeddings()(sample.input_ids[None]).detach().requires_grad_(True)
    contrast = hand_logprob(model, sample, answer, embeds) - hand_logprob(model, sample, foil, embeds)
    (expected,) = torch.autograd.grad(-contrast / len(answer), embeds)
    got = embedding_grads(model, sample.input_ids, sample.target_positions, target=Contrast(foil))
    torch.testing.assert_close(got, expected[0], atol=1e-6, rtol=1e-4)  # parts of the model run in fp32
    plain = embedding_grads(model, sample.input_ids, sample.target_positions)
    (default,) = torch.autograd.grad(-hand_logprob(model, sample, answer, embeds) / len(answer), embeds)
    torch.testing.assert_close(plain, default[0], atol=1e-6, rtol=1e-4)


def test_ablations_report_the_target_and_gradients_are_linear_in_it(story):
    model, tokenizer, sample, foil = story
    removed = torch.tensor([[False] * len(sample.sources), [True] + [False] * (len(sample.sources) - 1)])
    plain = faithfulness.answer_scores(model, sample, removed).logprob
    of_foil = faithfulness.answer_scores(
        model, sample, removed, faithfulness.Passes(target=lambda logits, _: answer_logprob(logits, foil))
    )
    contrasted = faithfulness.Passes(target=Contrast(foil))
    contrast = faithfulness.answer_scores(model, sample, removed, contrasted).logprob
    torch.testing.assert_close(contrast, plain - of_foil.logprob, atol=1e-8, rtol=0)
    with torch.no_grad():
        assert float(plain[0]) == pytest.approx(
            float(hand_logprob(model, sample, sample.input_ids[sample.target_positions]))
        )
    ids, targets = sample.input_ids, sample.target_positions
    foil_only = key_removal_gradient(
        model, ids, targets, target=lambda logits, _: answer_logprob(logits, foil)
    )
    torch.testing.assert_close(
        key_removal_gradient(model, ids, targets, target=Contrast(foil)),
        key_removal_gradient(model, ids, targets) - foil_only,
        atol=1e-8,
        rtol=1e-6,
    )


def test_detectors_take_the_target_and_record_it(story):
    model, tokenizer, sample, foil = story
    found = detectors.detect("key_removal_grad", model, tokenizer, sample, target=Contrast(foil))
    assert found.settings["target"] == f"contrast(foil={foil.tolist()})"
    shared = detectors.detect_many(
        ["attention", "information_flow", "embedding_grad"], model, tokenizer, sample,
        {"information_flow": {"target": Contrast(foil)}, "embedding_grad": {"target": Contrast(foil)}},
    )  # fmt: skip
    alone = detectors.detect("information_flow", model, tokenizer, sample, target=Contrast(foil))
    torch.testing.assert_close(shared["information_flow"].scores, alone.scores)
    assert "target" not in shared["attention"].settings
    with pytest.raises(ValueError, match="one shared pass explain one target"):
        detectors.detect_many(["information_flow", "embedding_grad"], model, tokenizer, sample,
                              {"information_flow": {"target": Contrast(foil)}})  # fmt: skip


def test_answer_token_targets_explain_one_token_and_sum_to_the_default():
    tokenizer = AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))
    sample = tasks.make("document-2", tokenizer, 256, seed=3)  # a name: an answer of several tokens
    model = probe.tiny_model("llama", vocab_size=len(tokenizer)).double()
    answer, k = sample.input_ids[sample.target_positions], len(sample.target_positions)
    assert k > 1
    embeds = model.get_input_embeddings()(sample.input_ids[None]).detach().requires_grad_(True)
    rows = model(inputs_embeds=embeds, use_cache=False).logits[0, sample.target_positions - 1].double()
    per_token = []
    for t in range(k):
        (expected,) = torch.autograd.grad(
            -torch.log_softmax(rows[t], -1)[answer[t]] / k, embeds, retain_graph=True
        )
        got = embedding_grads(model, sample.input_ids, sample.target_positions, target=AnswerToken(t))
        torch.testing.assert_close(got, expected[0], atol=1e-6, rtol=1e-4)  # parts of the model run in fp32
        per_token.append(got)
    whole = embedding_grads(model, sample.input_ids, sample.target_positions)
    torch.testing.assert_close(sum(per_token), whole, atol=1e-8, rtol=1e-6)
    full = torch.zeros(1, len(sample.sources), dtype=torch.bool)
    last_token = faithfulness.Passes(target=AnswerToken(-1))
    last = faithfulness.answer_scores(model, sample, full, last_token).logprob
    assert float(last[0]) == pytest.approx(
        float(torch.log_softmax(rows[-1].detach(), -1)[answer[-1]]), abs=1e-6
    )
    found = detectors.detect("embedding_grad", model, tokenizer, sample, target=AnswerToken(1))
    assert found.settings["target"] == "answer_token(1)"


def test_bad_targets_are_refused(story):
    model, tokenizer, sample, foil = story
    untouchable = probe.tiny_model("llama", vocab_size=len(tokenizer))
    untouchable.forward = None  # refused before any model work, or this fails with a TypeError
    with pytest.raises(ValueError, match="the foil has 2 tokens, the answer 1"):
        embedding_grads(
            model, sample.input_ids, sample.target_positions, target=Contrast(torch.tensor([5, 6]))
        )
    with pytest.raises(
        ValueError, match=r"AnswerToken\(1\) of an answer of 1 token\(s\): give an index from -1 to 0"
    ):
        detectors.detect("embedding_grad", untouchable, tokenizer, sample, target=AnswerToken(1))
    with pytest.raises(TypeError, match="AnswerToken's index must be an int"):
        AnswerToken("0")
    with pytest.raises(TypeError, match="target must be None .* or a callable"):
        embedding_grads(model, sample.input_ids, sample.target_positions, target="contrast")
